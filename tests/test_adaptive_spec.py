"""Load-adaptive speculation: the draft length of a step follows its batch size (engine/draft_schedule.py).

The schedule itself is checked on its own; then the engine with a real draft, stepped by hand so that requests
arrive and finish mid-run and the step's k goes from k to smaller, to 0 (the draft does not run and falls behind)
and back (the draft catches up on everything it missed in one chunk). Greedy output must stay the target's own
(checked against HF greedy through the `target_greedy` fixture), for a single-group draft and for a Gemma 3
hybrid draft whose sliding window (5 tokens) is shorter than what it has to catch up on.
"""

from __future__ import annotations

import pytest
from spec_support import ENGINE_KW, NEW_TOKENS, PROMPTS, record_steps

from engine import LLM, SamplingParams
from engine.config import SpeculativeConfig
from engine.draft_schedule import draft_length_for, format_schedule, parse_schedule
from engine.request import Request

pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------------------------------------
# The schedule
# --------------------------------------------------------------------------------------------------------


def test_draft_length_follows_schedule_and_threshold():
    sched = [(1, 4), (4, 3), (16, 1)]
    got = [draft_length_for(b, 4, sched, 32) for b in (1, 2, 4, 5, 16, 17, 32, 33, 100)]
    assert got == [4, 3, 3, 1, 1, 1, 1, 0, 0]
    # k is capped at num_speculative_tokens; no schedule means k everywhere; no threshold means never off.
    assert draft_length_for(1, 2, [(8, 5)], None) == 2
    assert [draft_length_for(b, 3, None, 8) for b in (1, 8, 9)] == [3, 3, 0]
    assert draft_length_for(10_000, 3, None, None) == 3
    assert draft_length_for(1, 3, None, 0) == 0  # threshold 0: never speculate


@pytest.mark.parametrize("value", ["1:4, 4:3,16:1", [[1, 4], [4, 3], [16, 1]], {1: 4, 4: 3, 16: 1},
                                   [(1, 4), ("4", "3"), (16, 1)]])
def test_parse_schedule_forms(value):
    assert parse_schedule(value) == [(1, 4), (4, 3), (16, 1)]
    assert format_schedule(parse_schedule(value)) == "1:4,4:3,16:1"


@pytest.mark.parametrize("value", [None, "", "none", "None"])
def test_parse_no_schedule(value):
    assert parse_schedule(value) is None


@pytest.mark.parametrize("schedule,disable,message", [
    ("4:4,2:2", None, "must increase"),
    ("4:5", None, "k must be an integer in [0, num_speculative_tokens=4]"),
    ("0:2", None, "max_batch_size must be an integer >= 1"),
    ("4-4", None, "is not MAX_BATCH:K"),
    ("4:x", None, "two integers"),
    (None, -1, "spec_disable_above_batch_size must be an integer >= 0"),
])
def test_bad_schedules_are_rejected_with_a_reason(schedule, disable, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        SpeculativeConfig("d", 4, draft_length_schedule=parse_schedule(schedule),
                          spec_disable_above_batch_size=disable).validate()


# --------------------------------------------------------------------------------------------------------
# The engine
# --------------------------------------------------------------------------------------------------------

# Batches of 1: k=3; 2: k=2; 3: k=1; 4 and more: no speculation.
SCHEDULE = "1:3,2:2,3:1"


def _run_with_arrivals(llm: LLM, arrivals: dict[int, list[tuple[list[int], int]]]) -> tuple[list, list[int]]:
    """Step `llm`'s engine by hand; before step i, add arrivals[i] (prompt, max_tokens). Returns the requests in
    arrival order and the k of every step."""
    engine, reqs, ks = llm.engine, [], []
    step = 0
    while step <= max(arrivals) or engine.has_unfinished():
        for prompt, max_tokens in arrivals.get(step, []):
            req = Request(f"r{len(reqs)}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            engine.add_request(req)
            reqs.append(req)
        engine.step()
        ks.append(engine.last_step.draft_length)
        step += 1
    return reqs, ks


@pytest.mark.parametrize("target,draft", [("llama", "near"), ("gemma3", "gemma3-2l")])
def test_greedy_stays_lossless_when_k_changes_between_steps(tiny_models, tiny_drafts, near_drafts, target_greedy,
                                                            target, draft):
    draft_path = near_drafts[target].path if draft == "near" else tiny_drafts[draft].path
    llm = LLM(tiny_models[target].path, draft_model=draft_path, num_speculative_tokens=3,
              rejection_sampling="strict", draft_length_schedule=SCHEDULE, spec_disable_above_batch_size=3,
              **ENGINE_KW)
    steps = record_steps(llm)
    expected = target_greedy(target)  # per PROMPTS[i], NEW_TOKENS tokens, already checked against HF
    # One request alone (k=3), then a burst of short ones (batch 5: off), which finish while the first runs on
    # (k back up as the batch shrinks). The long request decodes through every k, 0 included.
    short = 6
    arrivals = {0: [(PROMPTS[2], NEW_TOKENS)], 4: [(PROMPTS[0], short), (PROMPTS[1], short), (PROMPTS[0], short),
                                                    (PROMPTS[1], short + 2)]}
    reqs, ks = _run_with_arrivals(llm, arrivals)

    assert reqs[0].output_token_ids == expected[2]
    for r, i in zip(reqs[1:], (0, 1, 0, 1)):
        assert r.output_token_ids == expected[i][:r.params.max_tokens]
    # The step's k went 3 -> 0 (batch 5) -> up again; the long request decoded at k = 3, then 0, then k > 0.
    assert ks[0] == 3 and 0 in ks and any(k > 0 for k in ks[ks.index(0):]), ks
    mine = [s.num_draft_tokens for s in steps if s.request_id == "r0"][1:]  # after the prefill's own token
    assert mine[0] == 3 and 0 in mine and any(k > 0 for k in mine[mine.index(0):]), mine
    assert reqs[0].spec.num_drafts > 0


def test_draft_sits_out_steps_without_speculation_and_catches_up(tiny_models, near_drafts):
    """The draft neither runs nor allocates KV while the step's k is 0, and after one speculating step it has seen
    every committed token again."""
    llm = LLM(tiny_models["llama"].path, draft_model=near_drafts["llama"].path, num_speculative_tokens=2,
              rejection_sampling="strict", spec_disable_above_batch_size=1, **ENGINE_KW)
    engine = llm.engine
    forwards = []
    runner = engine.executor.draft
    forward = runner.forward_chunks
    runner.forward_chunks = lambda chunks: forwards.append(sum(len(c.token_ids) for c in chunks)) or forward(chunks)

    a = Request("a", PROMPTS[1], SamplingParams(max_tokens=20, ignore_eos=True))
    b = Request("b", PROMPTS[0], SamplingParams(max_tokens=4, ignore_eos=True))
    engine.add_request(a)
    engine.add_request(b)
    while b.status.value != "length":
        engine.step()
        assert engine.last_step.draft_length == 0
    assert forwards == []  # two requests > threshold 1: the draft never ran ...
    assert a.num_draft_computed_tokens == 0 and engine.draft_kv.num_used_blocks() == [0]  # ... nor held KV
    assert a.spec.num_drafts == 0
    seen = a.num_tokens - 1  # the target's frontier: everything but the last sampled token
    engine.step()  # alone now: k=2, the draft catches up on the prompt and every output so far, then proposes
    assert engine.last_step.draft_length == 2
    assert forwards[0] == seen + 1  # one catch-up chunk of every token the draft missed (plus the last one)
    assert a.spec.num_drafts == 1
    assert a.num_draft_computed_tokens >= seen
    while engine.has_unfinished():
        engine.step()
    assert engine.draft_kv.num_used_blocks() == [0] and engine.target_kv.num_used_blocks() == [0]


# --------------------------------------------------------------------------------------------------------
# Configuration: ServeConfig, YAML and `specserve serve` flags
# --------------------------------------------------------------------------------------------------------


def test_serve_config_yaml_and_flags_reach_the_engine(tmp_path):
    from deploy.cli import build_parser
    from deploy.config import ServeConfig, load_config

    base = {"model": "m", "draft_model": "d"}
    # Serving default: no static schedule, so the draft length rule chooses k (engine/speculation/draft_length_rule.py).
    assert ServeConfig.from_dict(base).engine_args()["spec_disable_above_batch_size"] is None
    assert ServeConfig.from_dict(base).engine_args()["draft_length_schedule"] is None
    assert "adaptive_draft_length" not in ServeConfig.from_dict(base).engine_args()  # EngineConfig's default: on
    off = ServeConfig.from_dict({**base, "adaptive_draft_length": False}).engine_args()
    assert off["adaptive_draft_length"] is False
    path = tmp_path / "serve.yaml"
    path.write_text("model: m\ndraft_model: d\ndraft_length_schedule: [[4, 4], [16, 2]]\n"
                    "spec_disable_above_batch_size: none\n")
    args = load_config(path).engine_args()
    assert args["draft_length_schedule"] == [(4, 4), (16, 2)] and args["spec_disable_above_batch_size"] is None
    # Flags override the file, in the "B:K" form.
    ns = build_parser().parse_args(["serve", "--config", str(path), "--draft-length-schedule", "2:3,8:1",
                                    "--spec-disable-above-batch-size", "8", "--num-speculative-tokens", "3"])
    flags = {k: v for k, v in vars(ns).items() if k not in ("command", "func", "verbose", "config")}
    args = load_config(path, flags).engine_args()
    assert args["draft_length_schedule"] == [(2, 3), (8, 1)] and args["spec_disable_above_batch_size"] == 8
    # A schedule the engine cannot follow fails before anything starts.
    with pytest.raises(ValueError, match="k must be an integer in"):
        ServeConfig.from_dict({**base, "draft_length_schedule": "4:9"}).engine_args()
    with pytest.raises(ValueError, match="is not MAX_BATCH:K"):
        ServeConfig.from_dict({**base, "draft_length_schedule": "4"}).engine_args()
