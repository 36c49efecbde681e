"""Defaults of serving options that serving's own functions take as well: declared once here, read by the options'
declaration (deploy/serve_options.py, ServingOptions) and by every function that defaults to one. No imports, so
that the options' declaration (the CLI's) pulls in nothing for them."""

# drain_timeout_s: on shutdown, seconds an engine replica's requests in flight may take to finish (serving/router/
# router.py, `drain`); a draft replica that stops waits as long for its targets to move (serving/draft_pool/pool.py).
DRAIN_TIMEOUT_S = 30.0
# draft_tenant_timeout_s: a draft replica frees the share of an engine replica it has not heard from for this long
# (serving/draft_pool/pool.py).
TENANT_TIMEOUT_S = 60.0
