"""The offline API: `LLM(model=..., draft_model=...).generate(prompts, SamplingParams(...))`, or vLLM's form
`LLM(model, speculative_config={"method": "eagle3" | "draft_model", "model": ..., "num_speculative_tokens": k})`."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from engine.config import LaunchConfig, option_default, resolve_device, resolve_dtype
from engine.engine_core import EngineCore
from engine.gc_heap import freeze_startup_heap
from engine.local_executor import LocalExecutor
from engine.model_setup import configure_engine, read_speculative_config, split_launch
from engine.request import Request, RequestOutput, RequestStatus, SamplingParams, SpecStats
from engine.runner.model_runner import ModelRunner

logger = logging.getLogger("specserve")


def load_tokenizer(path: str, trust_remote_code: bool = option_default("trust_remote_code")
                   ) -> PreTrainedTokenizerBase | None:
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:  # random-weight test models may ship without one
        logger.warning("no tokenizer in %s (%s): text prompts and outputs are unavailable", path, e)
        return None


class LLM:
    """A target model, optionally with a draft model for speculative decoding, in this process."""

    def __init__(self, model: str = LaunchConfig.model, draft_model: str | None = LaunchConfig.draft_model, *,
                 speculative_config: dict[str, object] | None = None, **options: object) -> None:
        """options: the engine options by name (engine.config.engine_options: LaunchConfig's device, dtype and
        max_model_len, SpeculativeConfig's num_speculative_tokens, rejection_sampling, ..., EngineConfig's seed,
        block_size, ...), each defaulting to its field's default there; any other name is a TypeError naming it.
        device and dtype also take torch.device / torch.dtype; draft_length_schedule also its text form ("4:4,16:2").
        speculative_config: vLLM's mapping (method "draft_model" or "eagle3", model, num_speculative_tokens, and
        the speculation options by name); its keys win over the keywords, and draft_model must then be unset."""
        options = {"model": model, "draft_model": draft_model, **options}
        if speculative_config is not None:
            if draft_model is not None:
                raise ValueError("give the draft either as draft_model or in speculative_config, not both")
            options["draft_model"], spec_options = read_speculative_config(dict(speculative_config))
            if "draft_tensor_parallel_size" in spec_options:
                spec_options["draft_tensor_parallel_size"] = int(spec_options["draft_tensor_parallel_size"])  # type: ignore[call-overload]
            options.update(spec_options)
        launch, engine_options = split_launch(options, "LLM()")
        draft_tp = engine_options.get("draft_tensor_parallel_size", option_default("draft_tensor_parallel_size"))
        if launch.draft_model is not None and draft_tp != 1:
            raise ValueError("the offline engine runs the draft in one process "
                             "(draft_tensor_parallel_size=1); use the Ray serving layer for more")
        dev = resolve_device(launch.device)
        pair, self.engine_config = configure_engine(launch.model, launch.draft_model, device=dev,
                                                    dtype=resolve_dtype(launch.dtype, dev),
                                                    max_model_len=launch.max_model_len, options=engine_options)
        target_cfg, draft_cfg, spec = pair.target, pair.draft, pair.spec
        self.engine_config.validate()
        self.model_config = target_cfg
        self.tokenizer = load_tokenizer(self.engine_config.tokenizer or str(target_cfg.path),
                                        self.engine_config.trust_remote_code)
        target = ModelRunner(target_cfg, self.engine_config, "target")
        draft = None
        if draft_cfg is not None and spec is not None:
            name = "eagle3" if spec.speculative_method == "eagle3" else "draft"
            draft = ModelRunner(draft_cfg, self.engine_config, name, draft_token_map=self.engine_config.draft_token_map)

        keep_probs = spec is not None and spec.rejection_sampling == "probabilistic"
        self.executor = LocalExecutor(target, draft, keep_probs, self.engine_config.seed)
        self.engine = EngineCore(self.executor, self.engine_config, self.tokenizer, target_cfg.eos_token_ids, spec)
        self._ids = itertools.count()
        self.gc_frozen = freeze_startup_heap(f"offline engine of {launch.model}")  # engine/gc_heap.py: why

    def _tokenize(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as lists of token ids")
            if not prompt:
                raise ValueError("prompt is empty: give at least one character")
            return prompt, self.tokenizer(prompt)["input_ids"]
        ids = list(prompt)
        if any(not isinstance(t, int) or isinstance(t, bool) for t in ids):
            raise ValueError("a token-id prompt must be a list of integers")
        return None, ids

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run prompts to completion, batched; outputs in the order of the prompts.

        All prompts are validated before any runs, so one bad prompt loses nothing already queued.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = ([sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams)
                  else list(sampling_params))
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        requests: list[tuple[str | None, Request]] = []
        for prompt, p in zip(prompts, params):
            p.validate()
            text, ids = self._tokenize(prompt)
            req = Request(f"gen-{next(self._ids)}", ids, p)
            self.engine.validate_request(req)
            requests.append((text, req))
        try:
            for _, req in requests:
                self.engine.add_request(req)
            while self.engine.has_unfinished():
                self.engine.step()
        except BaseException:
            for _, req in requests:
                self.engine.abort_request(req.request_id)
            raise
        return [_to_output(text, req) for text, req in requests]

    def chat(self, messages: list[dict[str, str]], sampling_params: SamplingParams | None = None) -> RequestOutput:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if not isinstance(ids, list):
            ids = ids["input_ids"]
        return self.generate([list(ids)], sampling_params)[0]

    def spec_stats(self, outputs: Sequence[RequestOutput]) -> SpecStats:
        total = SpecStats()
        for o in outputs:
            total.merge(o.spec)
        return total


def _to_output(prompt: str | None, req: Request) -> RequestOutput:
    return RequestOutput(request_id=req.request_id, prompt=prompt, prompt_token_ids=req.prompt_token_ids,
                         token_ids=list(req.output_token_ids), text=req.output_text,
                         finish_reason=req.finish_reason if req.status != RequestStatus.FINISHED_ABORTED
                         else "abort", spec=req.spec, stop_reason=req.stop_reason,
                         num_preemptions=req.num_preemptions, num_cached_tokens=req.num_cached_tokens or 0,
                         logprobs=[{tok: lp, **dict(top)} for tok, (lp, top) in zip(req.output_token_ids,
                                                                                    req.output_logprobs)]
                         if req.params.logprobs is not None else None,
                         prompt_logprobs=prompt_logprobs_dicts(req))


def prompt_logprobs_dicts(req: Request) -> list[dict[int, float] | None] | None:
    """vLLM's prompt_logprobs of a request that asked: None for the first prompt token, then per prompt token
    {token id: logprob} of the token itself, then its position's most likely tokens."""
    if req.params.prompt_logprobs is None:
        return None
    return [None] + [{tok: lp, **dict(top)} for tok, (lp, _rank, top) in zip(req.prompt_token_ids[1:],
                                                                          req.prompt_logprobs)]

