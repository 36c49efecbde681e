"""Bad input on a real server: the table of bad HTTP and gRPC requests, authentication and body limits
(test_reliability_http.py), and fuzzing from the app's own OpenAPI schema (test_fuzz.py). Both files share one
server (conftest.py), started once for the package: a local Ray, Serve's HTTP and gRPC proxies on 127.0.0.1, the
router stepping tiny byte-level models (target + draft) on their own worker actors."""

API_KEY = "test-key-8f2c"
MAX_BODY = 64 * 1024
MAX_MODEL_LEN = 128
