"""The GPT-OSS pair's launch line as vLLM users write it, `specserve serve openai/gpt-oss-120b --speculative-config
'{"method": "draft_model", "model": "openai/gpt-oss-20b", "num_speculative_tokens": 3}'`, run in a directory that
holds the two checkpoints under those names (tiny random models with a harmony tokenizer stand in for them here;
only CPU sizing and ports are added to the line). It serves: harmony chat with no parser flag (the tokenizer turns
it on), reasoning_effort through the template, the draft speculating; then Ctrl-C ends it with exit 0."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import httpx
from harmony_support import harmony_tokenizer, make_harmony_model
from serve_support import REPO, SERVE_CLI, free_port, scrape, wait_for_serve_cli

SEED_LINE = ["openai/gpt-oss-120b", "--speculative-config",
             '{"method": "draft_model", "model": "openai/gpt-oss-20b", "num_speculative_tokens": 3}']
GRAMMAR = ('start: <|channel|> "analysis" <|message|> /[a-z]{1,6}/ <|end|> <|start|> "assistant" <|channel|> '
           '"final" <|message|> "ok" <|return|>\n')


def test_seed_launch_line_serves_harmony_chat(tmp_path: Path) -> None:
    import openai

    make_harmony_model(tmp_path / "openai" / "gpt-oss-120b", draft=tmp_path / "openai" / "gpt-oss-20b")
    port, grpc_port = free_port(), free_port()
    # A cluster of its own, as on a user's machine (RAY_ADDRESS would join one).
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "PYTHONPATH": str(REPO),
           "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    log = (tmp_path / "serve.log").open("w+")
    proc = subprocess.Popen([*SERVE_CLI, *SEED_LINE, "--device", "cpu", "--port", str(port), "--grpc-port",
                             str(grpc_port), "--max-model-len", "512", "--block-size", "4", "--num-kv-blocks", "256",
                             "--max-num-batched-tokens", "64",
                             "--no-adaptive-draft-length"],  # a fixed k: the draft's drafts are counted
                            cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for_serve_cli(proc, Path(log.name), 240)
        oc = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=120)
        r = oc.chat.completions.create(model="openai/gpt-oss-120b", messages=[{"role": "user", "content": "hi"}],
                                       reasoning_effort="high", temperature=0, max_tokens=64,
                                       extra_body={"guided_grammar": GRAMMAR, "return_token_ids": True})
        choice = r.choices[0]
        assert "Reasoning: high\n" in harmony_tokenizer().decode(choice.prompt_token_ids)
        assert choice.message.content == "ok" and choice.finish_reason == "stop"
        assert choice.message.reasoning_content and choice.message.reasoning_content.isalpha()
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as c:
            assert scrape(c)["specserve_spec_decode_num_drafts_total"] > 0  # the draft of --speculative-config ran
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0, Path(log.name).read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
