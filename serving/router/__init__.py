# Serve configs name the in-process engine builder as serving.router:build_local_engine; it stays importable here.
from serving.engine_builders import build_local_engine  # noqa: F401
