"""Each engine option is declared once, by the engine's config dataclasses (engine.config.engine_options): LLM's
keyword arguments, the engine builders', the serve and `specserve generate` options and the distill options take
their defaults (and the serve options their types) from there, and no source file restates one."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import typing
from pathlib import Path

import pytest

from deploy import options
from deploy.cli import build_parser
from deploy.config import ServeConfig
from engine import LLM
from engine.config import EngineConfig, SpeculativeConfig, engine_options, option_default

ROOT = Path(__file__).resolve().parent.parent
OPTIONS = engine_options()
# Serve options whose default differs from the engine's on purpose (their help says what unset means served).
SERVING_DEFAULTS = {"draft_model": "auto"}
# Serve options that also take another form of the value than the engine's type (the text a flag gives).
WIDER_TYPES = {"draft_length_schedule": str}
# Where users set engine options, besides the declaration itself: every place that could restate a default.
ENTRY_POINTS = ["engine/llm.py", "engine/model_setup.py", "engine/distill/pipeline.py", "serving/engine_factory.py",
                "serving/engine_builders.py", "serving/draft_pool/pool.py", *sorted(
                    str(p.relative_to(ROOT)) for p in (ROOT / "deploy").glob("*.py"))]
# Fields of the same name with another meaning: the distilled draft's saved dtype and the training run's seed.
OTHER_MEANINGS = {("DistillConfig", "dtype"), ("DistillConfig", "seed")}


def _restated(value: ast.expr | None, name: str) -> bool:
    """A literal default for the engine option `name`: its declared default written again, or another value (None
    passes where it means "not given" and the declared default is something else)."""
    if not isinstance(value, ast.Constant):
        return False
    return value.value is not None or option_default(name) is None


def _restatements(path: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse((ROOT / path).read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            positional = a.posonlyargs + a.args
            pairs = list(zip(positional[len(positional) - len(a.defaults):], a.defaults))
            pairs += [(arg, d) for arg, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
            found += [f"{path}:{node.lineno} {node.name}({arg.arg}=...)" for arg, d in pairs
                      if arg.arg in OPTIONS and _restated(d, arg.arg)]
        elif isinstance(node, ast.ClassDef):
            found += [f"{path}:{st.lineno} {node.name}.{st.target.id}" for st in node.body
                      if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name) and st.target.id in OPTIONS
                      and (node.name, st.target.id) not in OTHER_MEANINGS and _restated(st.value, st.target.id)]
        elif isinstance(node, ast.Call):
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            words = [x.value for x in node.args if isinstance(x, ast.Constant) and isinstance(x.value, str)]
            names = {w.lstrip("-").replace("-", "_") for w in words} & set(OPTIONS)
            if func == "add_argument" and names:
                found += [f"{path}:{node.lineno} add_argument({words[0]}, default=...)" for kw in node.keywords
                          if kw.arg == "default" and _restated(kw.value, names.pop())]
            elif func == "set_defaults":
                found += [f"{path}:{node.lineno} set_defaults({kw.arg}=...)" for kw in node.keywords
                          if kw.arg in OPTIONS and _restated(kw.value, kw.arg)]
            elif func == "serving_option" and names:  # an engine option must be an engine_option row
                found.append(f"{path}:{node.lineno} serving_option({words[0]!r})")
    return found


def test_no_entry_point_restates_an_engine_default() -> None:
    found = [hit for path in ENTRY_POINTS for hit in _restatements(path)]
    assert not found, "engine option defaults written again (take them from engine.config.option_default):\n" + \
        "\n".join(found)


def test_the_check_catches_a_restated_default(tmp_path: Path) -> None:
    """The scan above flags each form a default could be restated in, and passes what takes it from the
    declaration."""
    src = tmp_path / "restated.py"
    src.write_text(
        "import argparse\n"
        "def build(model='smollm2-135m-instruct', *, seed=0, max_model_len=None, block_size=None): ...\n"
        "class Options:\n    num_speculative_tokens: int = 4\n    spec_disable_above_batch_size: int | None = None\n"
        "p = argparse.ArgumentParser()\np.add_argument('--num-speculative-tokens', type=int, default=4)\n"
        "p.set_defaults(draft_model=None)\nrow = serving_option('max_num_seqs', int, None)\n"
        "def fine(seed=None, num_speculative_tokens=option_default('num_speculative_tokens')): ...\n")
    hits = _restatements(str(src))  # an absolute path: ROOT / it is itself
    assert [h.split(" ", 1)[1] for h in hits] == [
        "build(model=...)", "build(seed=...)", "build(max_model_len=...)", "Options.num_speculative_tokens",
        "Options.spec_disable_above_batch_size", "add_argument(--num-speculative-tokens, default=...)",
        "set_defaults(draft_model=...)", "serving_option('max_num_seqs')"], hits


def test_serve_options_take_the_engine_fields_type_and_default() -> None:
    hints = typing.get_type_hints(ServeConfig)
    shared = [f for f in dataclasses.fields(ServeConfig) if f.name in OPTIONS]
    assert {f.name for f in shared} >= {"model", "draft_model", "num_speculative_tokens", "max_num_seqs", "seed",
                                        "tensor_parallel_size", "speculation_ahead", "draft_token_map"}
    for f in shared:
        cls, _ = OPTIONS[f.name]
        assert f.metadata["declared_by"] == cls.__name__, f.name
        expected = SERVING_DEFAULTS.get(f.name, option_default(f.name))
        assert options.default_of(f) == expected, f.name
        assert f.metadata["serving_default"] == (f.name in SERVING_DEFAULTS), f.name
        engine_hint = typing.get_type_hints(cls)[f.name]
        if f.name in WIDER_TYPES:
            assert set(typing.get_args(hints[f.name])) == set(typing.get_args(engine_hint)) | {WIDER_TYPES[f.name]}
        else:
            assert hints[f.name] == engine_hint, f.name


def test_generate_flags_default_to_the_engine_declaration() -> None:
    """`specserve generate` runs the engine offline: each engine option flag not given is the engine's default."""
    args = build_parser().parse_args(["generate", "--prompt", "x"])
    given = {k: v for k, v in vars(args).items() if k in OPTIONS}
    assert len(given) > 30
    for name, value in given.items():
        assert value == option_default(name), name


def test_distill_options_default_to_the_engine_declaration() -> None:
    from engine.distill.pipeline import DistillConfig

    for f in dataclasses.fields(DistillConfig):
        if f.name in OPTIONS and ("DistillConfig", f.name) not in OTHER_MEANINGS:
            assert f.default == option_default(f.name), f.name
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    distill = sub.choices["distill"]
    defaults = {a.dest: a.default for a in distill._actions if a.dest not in ("help", "out")}
    assert defaults.pop("target") == option_default("model")
    # The rest are absent unless given: the dataclasses' defaults hold.
    assert set(defaults.values()) == {argparse.SUPPRESS}, defaults


def test_builders_take_their_defaults_from_the_declaration() -> None:
    from serving.engine_builders import build_local_engine
    from serving.engine_factory import build_ray_engine

    for fn in (LLM.__init__, build_ray_engine, build_local_engine):
        params = inspect.signature(fn).parameters
        for name, p in params.items():
            if name in OPTIONS:
                assert p.default == option_default(name), (fn.__qualname__, name)
        assert any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()), fn.__qualname__
    # The builders' own option that serving declares too: one default for both.
    from serving.workers.ray_executor import RayExecutor

    served = ServeConfig().draft_placement
    for fn in (build_ray_engine, build_local_engine, RayExecutor.__init__):
        assert inspect.signature(fn).parameters["draft_placement"].default == served, fn.__qualname__


def test_serving_timeouts_default_to_the_serve_options() -> None:
    """The drain and tenant timeouts are serving options whose functions take them too: each has one default, the
    option's, wherever a function defaults it."""
    from serving import app
    from serving.draft_pool.pool import DraftPoolReplica
    from serving.router.router import Router

    served = ServeConfig()
    pool = inspect.signature(DraftPoolReplica.func_or_class.__init__).parameters
    assert pool["tenant_timeout_s"].default == served.draft_tenant_timeout_s
    for name, param in (("DraftPoolReplica", pool["drain_timeout_s"]),
                        ("Router.drain", inspect.signature(Router.drain).parameters["timeout_s"]),
                        ("serving.app.drain", inspect.signature(app.drain).parameters["timeout_s"])):
        assert param.default == served.drain_timeout_s, name
    # The defaults are not written into the functions again: a different declared value would reach them all.
    for path in ("serving/app.py", "serving/draft_pool/pool.py", "serving/router/router.py", "deploy/serve_options.py"):
        source = (ROOT / path).read_text()
        assert f"= {served.drain_timeout_s!r}" not in source and f"= {served.draft_tenant_timeout_s!r}" not in source, \
            path
        assert f'"drain_timeout_s", {served.drain_timeout_s!r}' not in source, path
        assert f'"draft_tenant_timeout_s", {served.draft_tenant_timeout_s!r}' not in source, path
        assert f"option({served.drain_timeout_s!r}," not in source, path
        assert f"option({served.draft_tenant_timeout_s!r}," not in source, path


def test_llm_without_options_runs_every_declared_default(tmp_path: Path) -> None:
    """LLM(model, draft_model) builds the EngineConfig and SpeculativeConfig of their fields' defaults; served
    defaults reach the same engine; unknown names are a TypeError naming each."""
    from byte_models import make_byte_models

    target, draft = make_byte_models(tmp_path)
    llm = LLM(target, draft_model=draft, device="cpu")
    for name, (cls, _) in OPTIONS.items():
        if cls is EngineConfig:
            assert getattr(llm.engine_config, name) == option_default(name), name
        elif cls is SpeculativeConfig:
            assert getattr(llm.engine.spec_config, name) == option_default(name), name
    served = ServeConfig(model=target, draft_model=draft, device="cpu").engine_args()
    assert LLM(**served).engine_config == llm.engine_config
    with pytest.raises(TypeError, match=r"unknown option\(s\) 'block_sz', 'num_spec_tokens'"):
        LLM(target, draft_model=draft, block_sz=8, num_spec_tokens=3)
