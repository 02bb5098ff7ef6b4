"""The `hf` backend: transformers `generate` in the generation process, with behaviour log-probs recorded per step.

μ is recorded by logits processors in O(B·L) memory: the vocabulary-sized scores of a step are never stacked
(`output_logits`/`output_scores` would keep B·L·V floats: ~10 GB for Qwen's 151,936-token vocabulary at 64 rows × 256
tokens). Each distinct prompt is prefilled once (GRPO repeats every prompt `num_generations` times).

Several generation batches decode in one `generate` call (`HFBackend.generate_batches`): on a GPU a decode of 32 rows
is bound by kernel launches, so more rows cost little more time, and on a CPU the weights read per step are shared by
more rows. Each batch's rows are sampled from that batch's own generator (`_SeededSampler`), so a batch's samples do not
depend on the batches decoded beside it. On CUDA the decode can run as CUDA graphs (`HFBackend(cuda_graphs=True)`): a
static KV cache and `torch.compile`'s reduce-overhead mode, every call padded to one shape.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
from collections.abc import Callable, Sequence

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, LogitsProcessor, LogitsProcessorList

from ...timeline import current as timeline
from ...timeline import names as span
from .base import BackendContext, GenerationBackend, GenerationOutput, SeededPrompts, first_eos_mask

logger = logging.getLogger(__name__)


class _PrefillThenDecode:
    """The timeline's split of one `generate` call (`trl_async.timeline`): the prefill runs until the first scores
    reach the logits processors (the prompts' forward is done), the decode from there to the end."""

    __slots__ = ("_recorder", "_start", "_decoding")

    def __init__(self):
        self._recorder = timeline()
        self._start, self._decoding = self._recorder.begin(), False

    def scores_seen(self) -> None:
        if not self._decoding:
            self._recorder.end(span.PREFILL, self._start)
            self._start, self._decoding = self._recorder.begin(), True

    def finish(self, rows: int) -> None:
        """`rows`: the rows of the call (several generation batches may share it), shown with the span."""
        self._recorder.end(span.DECODE if self._decoding else span.PREFILL, self._start, args={"rows": rows})


class _SampledTokenLogprobs(LogitsProcessor):
    """Records log μ(y_t) of each sampled token, from the scores it sees.

    The sampling recorder runs LAST (after the warpers; see `_recording_behaviour_logprobs`): it sees the fully
    processed scores `generate` samples from. A second one, with `temperature`, runs FIRST, on the raw logits: it
    records the trainer's parametrization (`GenerationOutput.importance_logprobs`). Both return the scores unchanged. At step t
    it keeps a reference to step t's processed scores (which `generate` holds anyway until step t+1) and their
    log-normalizer; at step t+1 the sampled token y_t is the last column of `input_ids`, and
    log μ(y_t) = score_t[y_t] − logsumexp(score_t). Memory: one (B,) vector per step, never a (B, L, V) stack.
    """

    def __init__(self, beat: Callable[[], None] | None = None, temperature: float = 1.0):
        self.beat = beat
        # Set for the recorder that runs FIRST, on raw logits: it records the trainer's parametrization of μ
        # (logits / temperature), which `GenerationOutput.importance_logprobs` explains.
        self.temperature = temperature
        self.steps: list[torch.Tensor] = []
        self._scores = None
        self._log_normalizer = None
        # Set (by `_recording_behaviour_logprobs`) when another recorder sees exactly the scores this one would.
        self.same_as: _SampledTokenLogprobs | None = None
        self.result: torch.Tensor | None = None  # set by `finish`; read by a recorder that is `same_as` this one
        self.phases: _PrefillThenDecode | None = None  # the timeline's prefill / decode split (the sampler's recorder)

    def _record_previous(self, sampled: torch.Tensor) -> None:
        if self._scores is not None and self._scores.size(0) == sampled.size(0):  # else beam search: see `finish`
            picked = self._scores.gather(1, sampled.unsqueeze(1)).squeeze(1)
            self.steps.append((picked - self._log_normalizer).float())

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.phases is not None:
            self.phases.scores_seen()
        if self._scores is not None:
            self._record_previous(input_ids[:, -1])
        self._scores = scores / self.temperature if self.temperature != 1.0 else scores
        self._log_normalizer = torch.logsumexp(self._scores, dim=-1)
        if self.beat is not None:
            self.beat()
        return scores

    def finish(self, completion_ids: torch.Tensor) -> torch.Tensor:
        """(B, L) log-probs of the (B, L) completion `generate` returned."""
        if self.same_as is not None:
            return self.same_as.result
        self.result = self._finish(completion_ids)
        return self.result

    def _finish(self, completion_ids: torch.Tensor) -> torch.Tensor:
        num_tokens = completion_ids.size(1)
        if num_tokens == 0:
            return torch.zeros(completion_ids.shape, device=completion_ids.device)
        self._record_previous(completion_ids[:, -1])
        self._scores = self._log_normalizer = None
        # `generate` may run a step past the end and undo it (deferred stop checks): keep the first L steps. A
        # `generate` that ran no processors (a replaced or mocked one) leaves steps unknown: NaN, which the importance
        # correction treats as TRL treats vLLM's missing log-probs (no correction for those tokens).
        steps = self.steps[:num_tokens]
        if steps and steps[0].size(0) != completion_ids.size(0):
            # Beam search (`num_beams > 1` in `generation_kwargs`) scores num_beams candidates per row and samples
            # none of the returned tokens from one distribution: no μ exists, so no correction (NaN, as above).
            steps = []
        missing = num_tokens - len(steps)
        if missing:
            steps += [torch.full((completion_ids.size(0),), float("nan"), device=completion_ids.device)] * missing
        return torch.stack(steps, dim=1)


class _SeededSampler(LogitsProcessor):
    """Samples each row's next token from the scores `generate` samples from, with the generator of the row's
    generation batch, and hands `generate` scores that leave it no other choice (0 at that token, -inf elsewhere).

    Runs LAST, after the μ recorder: it sees exactly the processed distribution μ. Inverse-CDF sampling: one uniform u
    per row from its batch's generator, the token is the first whose cumulative probability exceeds u times the total,
    which is a draw from softmax(scores) (a token of probability 0 is never the first to exceed it). `generate` then
    samples its one-hot distribution with its own RNG, which can pick nothing else. Why not `generate`'s own
    multinomial: it draws every row from one global RNG, so a row's sample would depend on how many rows share the
    call; here a batch draws the same numbers whether it is decoded alone or beside others. One uniform per row and
    step, whatever the row's distribution, so the draws of a batch follow from its seed and the step alone."""

    def __init__(self, segments: Sequence[tuple[int, int | None]], device: torch.device):
        self.segments = []  # (first row, end row, generator or None: the caller's RNG)
        start = 0
        for num_rows, seed in segments:
            generator = None
            if seed is not None:
                generator = torch.Generator(device=device)
                generator.manual_seed(int(seed))
            self.segments.append((start, start + num_rows, generator))
            start += num_rows

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(scores.float(), dim=-1)
        uniform = torch.cat(
            [torch.rand(end - start, generator=g, device=scores.device) for start, end, g in self.segments]
        )
        cumulative = probs.cumsum(dim=-1)
        threshold = (uniform * cumulative[:, -1]).unsqueeze(1)
        tokens = torch.searchsorted(cumulative, threshold, right=True).squeeze(1)
        # Float rounding can put the threshold at the total itself (u * total rounded up): the draw belongs to the
        # last token of positive probability, not past the end.
        vocabulary = probs.size(-1)
        last_positive = vocabulary - 1 - (probs.flip(-1) > 0).int().argmax(dim=-1)
        tokens = torch.minimum(tokens, last_positive)
        chosen = torch.full_like(scores, -torch.inf)
        return chosen.scatter_(1, tokens.unsqueeze(1), 0.0)


class _ProcessorsReadOnce(LogitsProcessorList):
    """transformers' `LogitsProcessorList`, reading each processor's signature once per `generate` call instead of at
    every decoding step.

    `LogitsProcessorList.__call__` runs `inspect.signature` on every processor at every step (~0.1 ms each): with
    `min_new_tokens` (two length processors) and the two μ recorders, 8% of a 64-token batch on the tiny model, one
    core. The processors do not change during a call, so their parameters are read once; what is called, with which
    arguments, and the error for a missing keyword are `LogitsProcessorList`'s (`tests/test_backends.py` holds the
    two to the same results).
    """

    def __init__(self, processors):
        super().__init__(processors)
        self._parameters: dict[int, list[str]] = {}  # id(processor) -> the names of its `__call__` parameters

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        for processor in self:
            parameters = self._parameters.get(id(processor))
            if parameters is None:
                parameters = self._parameters[id(processor)] = list(inspect.signature(processor.__call__).parameters)
            if len(parameters) > 2:
                if not all(name in kwargs for name in parameters[2:]):
                    raise ValueError(
                        f"Make sure that all the required parameters: {parameters} for {processor.__class__} are "
                        "passed to the logits processor."
                    )
                scores = processor(input_ids, scores, **kwargs)
            else:
                scores = processor(input_ids, scores)
        return scores


def _generation_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model whose `generate` builds the logits processors (inside DDP and PEFT wrappers)."""
    model = getattr(model, "module", model)  # DDP
    if hasattr(model, "get_base_model"):  # PEFT: PeftModel.generate delegates to the base transformers model
        model = model.get_base_model()
    return model


@contextlib.contextmanager
def _recording_behaviour_logprobs(
    model: torch.nn.Module,
    recorder: _SampledTokenLogprobs,
    policy_recorder: _SampledTokenLogprobs | None = None,
    sampler: _SeededSampler | None = None,
):
    """Append `recorder` after every processor and warper that `generate` builds for this model, and `sampler` (if
    any) after it, and put `policy_recorder` (if any) before all of them, on the raw logits.

    transformers merges user `logits_processor`s *before* its warpers (temperature, top-k, top-p, min-p), so a user
    processor would see unwarped scores. Wrapping this model instance's `_get_logits_processor` (only for this call)
    puts the recorder at the very end, where it sees exactly the scores `generate` samples from.
    """
    target = _generation_model(model)
    build_processors = target._get_logits_processor

    def with_recorder(*args, **kwargs):
        processors = build_processors(*args, **kwargs)
        if policy_recorder is not None:
            if not processors and policy_recorder.temperature == 1.0:
                # Nothing transforms the logits (TRL's defaults): both recorders would see the same scores.
                policy_recorder.same_as = recorder
            else:
                processors.insert(0, policy_recorder)
        processors.append(recorder)
        if sampler is not None:
            processors.append(sampler)
        return _ProcessorsReadOnce(processors)

    target._get_logits_processor = with_recorder
    try:
        yield
    finally:
        del target._get_logits_processor  # back to the class's method


def _shared_prompt_cache(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, generation_config
):
    """The KV cache of every row's prompt but its last token, computed once per distinct prompt; None where it does
    not apply.

    GRPO samples `num_generations` completions of each prompt, and `generate` prefills every row: for the docs-style
    batch (4 prompts × 8 rows × 17 tokens) the prefill is ~20 ms of a ~150 ms generation on one core. Here one row per
    distinct prompt (same tokens, same left padding) runs the first width−1 tokens, with the position ids `generate`
    gives them, and the cache is repeated to every row of its prompt; `generate` then starts from the cache's length:
    it runs each row's last prompt token and samples on. The rows see the same keys and values as in a full prefill
    (equal up to float summation order: `tests/test_backends.py`).

    Only for a plain decoder with transformers' dynamic cache, one sequence per row (no beams, no
    `num_return_sequences`), and only where prompts repeat (at most half as many distinct prompts as rows)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer
    from transformers.generation.utils import ALL_CACHE_NAMES

    target = _generation_model(model)
    config = getattr(target, "config", None)
    num_rows, width = input_ids.shape
    if (
        config is None
        or config.is_encoder_decoder
        or width < 2
        or (generation_config.num_beams or 1) != 1
        or (generation_config.num_return_sequences or 1) != 1
        or generation_config.cache_implementation is not None
        or not getattr(target, "_supports_default_dynamic_cache", lambda: False)()
    ):
        return None
    rows = torch.cat([input_ids, attention_mask], dim=1)
    distinct, row_to_prompt = torch.unique(rows, dim=0, return_inverse=True)
    if 2 * distinct.size(0) > num_rows:
        return None
    prefix_ids, prefix_mask = distinct[:, : width - 1], distinct[:, width : 2 * width - 1]
    position_ids = (prefix_mask.long().cumsum(-1) - 1).masked_fill(prefix_mask == 0, 0)  # as `generate` makes them
    cache_name = ALL_CACHE_NAMES[0]  # "cache" (transformers >= 5.20) or "past_key_values"
    outputs = target(
        input_ids=prefix_ids, attention_mask=prefix_mask, position_ids=position_ids, use_cache=True, logits_to_keep=1
    )
    cache = getattr(outputs, cache_name, None)
    if type(cache) is not DynamicCache or not all(isinstance(layer, DynamicLayer) for layer in cache.layers):
        return None
    cache.batch_select_indices(row_to_prompt)
    return {cache_name: cache}


def generation_config_for_rollouts(generation_config: GenerationConfig) -> GenerationConfig:
    """Our copy of TRL's generation config: the KV cache on (trainers switch `use_cache` off for training; without
    it generation is quadratic, 10x slower here), plain tensors out (μ is recorded, nothing vocabulary-sized kept)."""
    config = copy.deepcopy(generation_config)
    config.use_cache = True
    config.return_dict_in_generate = False
    config.output_logits = False
    config.output_scores = False
    return config


def _samples_per_row(generation_config: GenerationConfig) -> bool:
    """Whether `generate` samples one token per row from one distribution (not greedy, not beam search): where the
    rows' draws can come from their own batches' generators (`_SeededSampler`)."""
    return (
        bool(generation_config.do_sample)
        and (generation_config.num_beams or 1) == 1
        and (generation_config.num_return_sequences or 1) == 1
    )


@torch.no_grad()
def generate_with_behaviour_logprobs(
    model: torch.nn.Module,
    prompt_ids: list[list[int]],
    generation_config: GenerationConfig,
    eos_token_ids: list[int],
    pad_token_id: int,
    device: torch.device | str,
    seed: int | None = None,
    heartbeat: Callable[[], None] | None = None,
    ready: Callable[[], None] | None = None,
    segments: Sequence[tuple[int, int | None]] | None = None,
    width_multiple: int = 1,
) -> GenerationOutput:
    """Sample one completion per prompt with transformers `generate`, recording μ of every sampled token.

    `segments`: the rows as consecutive generation batches, `(rows, seed)` each; default one batch of every row with
    `seed`. Each batch's rows are sampled from its own seed (`_SeededSampler`), so a batch is a function of (weights,
    prompts, seed) wherever it is generated (in the generation process or in the trainer) and whatever is decoded
    beside it; the caller's RNG state is left as it was. A batch without a seed draws from the caller's RNG.
    `heartbeat()` runs at every decoding step, once that step's scores are recorded (in-flight weight updates load
    newer weights there, for the next step's forward); `ready()` once the batch is laid out, before any forward.
    `width_multiple`: pad the prompts (on the left) to a multiple of this width (a few fixed shapes for CUDA graphs).
    """
    device = torch.device(device)
    segments = [(len(prompt_ids), seed)] if segments is None else list(segments)
    if sum(rows for rows, _ in segments) != len(prompt_ids):
        raise ValueError(f"segments {segments} do not cover the {len(prompt_ids)} prompt rows")
    width = max(len(p) for p in prompt_ids)
    width = -(-width // width_multiple) * width_multiple
    input_ids = torch.full((len(prompt_ids), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompt_ids), width), dtype=torch.long)
    for row, ids in enumerate(prompt_ids):  # left padding, as TRL does for generation
        input_ids[row, width - len(ids) :] = torch.tensor(ids)
        attention_mask[row, width - len(ids) :] = 1
    recorder = _SampledTokenLogprobs(heartbeat)
    policy_recorder = _SampledTokenLogprobs(temperature=generation_config.temperature or 1.0)
    seeds = [s for _, s in segments if s is not None]
    sampler = _SeededSampler(segments, device) if _samples_per_row(generation_config) else None
    cuda_devices = [device] if device.type == "cuda" else []
    # With a seed, sample from it and leave the caller's RNG as it was; without one, draw from the caller's RNG.
    rng = torch.random.fork_rng(devices=cuda_devices) if seeds else contextlib.nullcontext()
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    with rng, _recording_behaviour_logprobs(model, recorder, policy_recorder, sampler):
        if ready is not None:  # before the prefill too: every key/value comes from weights at least this recent
            ready()
        recorder.phases = _PrefillThenDecode()  # the first scores mark the end of the prefill
        prefilled = _shared_prompt_cache(model, input_ids, attention_mask, generation_config) or {}
        if seeds:
            # What the seeded sampler leaves to `generate`'s RNG (a one-hot draw), or greedy / beam search's own use.
            torch.manual_seed(seeds[0])
        sequences = model.generate(
            input_ids=input_ids, attention_mask=attention_mask, generation_config=generation_config, **prefilled
        )
        recorder.phases.finish(len(prompt_ids))
    completion_ids = sequences[:, width:]
    mask = first_eos_mask(completion_ids, eos_token_ids)
    completion_ids = completion_ids.masked_fill(~mask, pad_token_id)
    # Positions after the first EOS are padding: their recorded value is meaningless (possibly -inf).
    logprobs, policy_logprobs = (  # the sampler's recorder first: the policy one may hand back its result
        torch.where(mask, r.finish(sequences[:, width:]).to(mask.device), torch.zeros((), device=mask.device))
        for r in (recorder, policy_recorder)
    )
    return GenerationOutput(
        completion_ids=completion_ids, completion_mask=mask, logprobs=logprobs, policy_logprobs=policy_logprobs
    )


class HFBackend(GenerationBackend):
    """transformers `generate` on the generator's own copy of the policy, on any device, CPU included.

    Options beyond the `BackendContext`:
        inflight_weight_updates: load newer published weights between decoding steps (`generate`).
        cuda_graphs: decode with a static KV cache and `torch.compile`'s reduce-overhead mode (CUDA graphs), every
            call padded to `decode_rows` rows and a prompt width that is a multiple of `CUDA_GRAPH_WIDTH_MULTIPLE`, so
            that the graphs are captured once (`warm_up`). A failed compilation falls back to eager decoding with a
            warning (`compile_fallbacks`), never an error.
        decode_rows: the most rows one call decodes (the generation process's block); the shape CUDA graphs pad to.
    """

    name = "hf"
    CUDA_GRAPH_WIDTH_MULTIPLE = 64

    def __init__(
        self,
        context: BackendContext,
        *,
        inflight_weight_updates: bool = False,
        cuda_graphs: bool = False,
        decode_rows: int | None = None,
    ):
        super().__init__(context)
        self.inflight_weight_updates = inflight_weight_updates
        self.generation_config = generation_config_for_rollouts(context.generation_config)
        self.cuda_graphs = cuda_graphs
        self.decode_rows = decode_rows
        if cuda_graphs:
            _use_cuda_graphs(self.generation_config)
        self.model = None

    def load(self) -> int:
        """Build the policy copy without initializing it: parameters on the `meta` device (accelerate's
        `init_empty_weights`, buffers built as usual), then each one made from the trainer's published tensors
        (`materialize_from_stores`). No random initialization of the full model runs, on any device: at Qwen2.5-0.5B's
        size on 2 CPU cores the old path (`from_config` then copying the weights in) took 10.8 s of a 12.4 s start."""
        from accelerate import init_empty_weights

        spec = self.model_spec
        config = copy.deepcopy(spec.config)
        config.use_cache = True
        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(config, dtype=spec.dtype)
            if spec.peft_config is not None:
                from peft import get_peft_model

                # The adapter's values come from the trainer: the default init (no SVD of meta weights, as PiSSA-style
                # inits would run) is only its shape.
                peft_config = copy.copy(spec.peft_config)
                peft_config.init_lora_weights = True
                model = get_peft_model(model, peft_config, adapter_name=spec.adapter_name)
        if spec.generation_defaults is not None:
            _generation_model(model).generation_config = copy.deepcopy(spec.generation_defaults)
        materialize_from_stores(model, self.frozen_store, self.trainable_store, self.device)
        model.to(self.device).eval()  # the buffers (rotary tables) move; the parameters are there already
        self.model = model
        self._params = dict(model.named_parameters())
        return self.update_weights()

    def warm_up(self, sample_prompt_ids) -> None:
        """Capture the CUDA graphs before the generation process reports ready (the trainer makes its own batches
        meanwhile): one decode of the shape every later call is padded to, from these prompts, discarded. A failure
        turns CUDA graphs off (`compile_fallbacks`) instead of failing the run."""
        if not self.cuda_graphs:
            return
        prompt_ids = sample_prompt_ids()
        if not prompt_ids:
            return
        rows = self.decode_rows or len(prompt_ids)
        sample = [prompt_ids[i % len(prompt_ids)] for i in range(rows)]
        with timeline().span(span.COMPILE_DECODE):
            self._decode_or_fall_back(sample, [(rows, 0)], ready=None)

    def update_weights(self) -> int:
        # In place (`copy_` into the parameters): tensor addresses stay, and with them any captured CUDA graph.
        if self.trainable_store.version != self.version:
            with timeline().span(span.LOAD_WEIGHTS):
                self.version = self.trainable_store.read_into(self._params)
        return self.version

    def generate(self, prompt_ids: list[list[int]], seed: int | None = None, ready=None) -> GenerationOutput:
        return self.generate_batches([SeededPrompts(prompt_ids, seed)], ready)[0]

    def generate_batches(self, batches: Sequence[SeededPrompts], ready=None) -> list[GenerationOutput]:
        """Every batch's rows in one `generate` call, each batch sampled from its own seed; one output per batch."""
        prompt_ids = [ids for batch in batches for ids in batch.prompt_ids]
        segments = [(len(batch.prompt_ids), batch.seed) for batch in batches]
        if self.cuda_graphs and self.decode_rows and len(prompt_ids) < self.decode_rows:
            # Padded to the captured shape with copies of the first prompt, sampled apart and dropped.
            padding = self.decode_rows - len(prompt_ids)
            prompt_ids = prompt_ids + [prompt_ids[0]] * padding
            segments = segments + [(padding, 0)]
        out = self._decode_or_fall_back(prompt_ids, segments, ready)
        sizes = [len(batch.prompt_ids) for batch in batches]
        return out.split(sizes + ([len(prompt_ids) - sum(sizes)] if len(prompt_ids) > sum(sizes) else []))[
            : len(batches)
        ]

    def _decode_or_fall_back(self, prompt_ids, segments, ready) -> GenerationOutput:
        if not self.cuda_graphs:
            return self._decode(prompt_ids, segments, ready)
        try:
            return self._decode(prompt_ids, segments, ready)
        except Exception as error:  # noqa: BLE001 (any compiler failure: eager decoding is always possible)
            if not _is_compile_failure(error):
                raise
            logger.warning(
                "trl_async: decoding with CUDA graphs failed (%s: %s); the generation process decodes eagerly from "
                "now on (set generation_cuda_graphs='off' to skip the attempt).", type(error).__name__,
                str(error).splitlines()[0] if str(error) else "",
            )  # fmt: skip
            self.cuda_graphs = False
            self.compile_fallbacks += 1
            self.generation_config = generation_config_for_rollouts(self.context.generation_config)
            return self._decode(prompt_ids, segments, ready=None)  # `ready` ran (or raised) before the failure

    def _decode(self, prompt_ids, segments, ready) -> GenerationOutput:
        # Inference mode, not only no_grad: the decoding loop's tensors skip version counters and view tracking (~4%
        # faster decoding on the tiny model, 1 thread). This model never trains. The results are cloned outside it,
        # so that callers (tensor rewards) get ordinary tensors they may use however they like.
        step_versions: list[int] = []

        def between_steps():
            self.heartbeat()
            step_versions.append(self.version)  # the weights that computed this step's scores, hence its token
            if self.inflight_weight_updates:
                # In-flight: the next step's forward runs on the newest published weights. The key/value cache of
                # the tokens so far stays as the older weights computed it (as PipelineRL keeps it); μ of every
                # token is recorded from the distribution that sampled it, so the importance weights stay exact.
                self.update_weights()

        with torch.inference_mode():
            out = generate_with_behaviour_logprobs(
                self.model,
                prompt_ids,
                self.generation_config,
                self.eos_token_ids,
                self.pad_token_id,
                self.device,
                heartbeat=between_steps,
                ready=ready,
                segments=segments,
                width_multiple=self.CUDA_GRAPH_WIDTH_MULTIPLE if self.cuda_graphs else 1,
            )
        policy_logprobs = out.policy_logprobs
        return GenerationOutput(
            completion_ids=out.completion_ids.clone(),
            completion_mask=out.completion_mask.clone(),
            logprobs=out.logprobs.clone(),
            policy_logprobs=None if policy_logprobs is None else policy_logprobs.clone(),
            token_versions=_token_versions(step_versions, out.completion_ids, self.version),
        )


def _use_cuda_graphs(generation_config: GenerationConfig) -> None:
    """transformers' CUDA-graph decoding: a static KV cache and its compile config (reduce-overhead mode). TRL turns
    compilation off in its own config (`disable_compile=True`); this copy is the generation process's own."""
    from transformers import CompileConfig

    generation_config.cache_implementation = "static"
    generation_config.compile_config = CompileConfig(mode="reduce-overhead", fullgraph=False, dynamic=False)
    generation_config.disable_compile = False


def _is_compile_failure(error: BaseException) -> bool:
    """An error raised by torch.compile's stack (dynamo, inductor, CUDA-graph trees), not by the model or the run."""
    module = type(error).__module__ or ""
    if module.startswith(("torch._dynamo", "torch._inductor", "torch.fx", "torch._subclasses")):
        return True
    chained = error.__cause__ or error.__context__
    return chained is not None and chained is not error and _is_compile_failure(chained)


def materialize_from_stores(model: torch.nn.Module, frozen_store, trainable_store, device: torch.device) -> None:
    """Give every parameter of a model built on the `meta` device its storage: the trainer's published tensors.

    A frozen tensor already in this process's memory in the parameter's dtype (shared memory, on the CPU) is used as
    it is, without a copy (a LoRA model's 0.5B base costs no second 2 GB); any other is copied to `device`. A
    trainable one gets fresh storage, filled by `update_weights` (`read_into`, in place, at every version). Tied
    parameters (the output embedding of Qwen's small models) share one tensor, as `from_pretrained` leaves them. A
    parameter the trainer publishes under no name, or a published name the model lacks, is an error naming them."""
    frozen = frozen_store.buffers if frozen_store is not None else {}
    trainable = trainable_store.buffers
    names = {name for name, _ in model.named_parameters()}
    unknown = [name for name in [*frozen, *trainable] if name not in names]
    if unknown:
        raise RuntimeError(
            f"The generator's model has no parameters named like the trainer's, e.g. {unknown[:3]}. The generator "
            "rebuilds the model from its config (and PEFT config); models whose parameter names differ after that are "
            "not supported."
        )
    owners: dict[int, list[str]] = {}  # id(parameter) -> every name it goes by (tied parameters: several)
    for name, parameter in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(parameter), []).append(name)
    _tie_output_embeddings(model, owners)
    made: dict[int, torch.nn.Parameter] = {}
    missing = []
    for name, parameter in model.named_parameters():
        if name in frozen:
            source = frozen[name]
            if source.device == device and source.dtype == parameter.dtype:
                data = source
            else:
                data = source.to(device=device, dtype=parameter.dtype)
        elif name in trainable:
            data = torch.zeros(parameter.shape, dtype=parameter.dtype, device=device)
        else:
            missing.append(name)
            continue
        made[id(parameter)] = torch.nn.Parameter(data, requires_grad=False)
    if missing:
        raise RuntimeError(
            f"The trainer publishes no weights for {len(missing)} of the generator's parameters, e.g. {missing[:3]}."
        )
    for key, names in owners.items():
        for name in names:
            module_name, _, leaf = name.rpartition(".")
            model.get_submodule(module_name)._parameters[leaf] = made[key]


def _tie_output_embeddings(model: torch.nn.Module, owners: dict[int, list[str]]) -> None:
    """Built on `meta`, transformers leaves `lm_head` untied from the input embedding even where the config ties
    them (`from_pretrained` ties them after loading): tie them the same way, so that the one published tensor fills
    both."""
    target = _generation_model(model)
    if not getattr(target.config.get_text_config(decoder=True), "tie_word_embeddings", False):
        return
    output, embedding = target.get_output_embeddings(), target.get_input_embeddings()
    if output is None or embedding is None or output.weight is embedding.weight:
        return
    names = owners.pop(id(output.weight))
    output.weight = embedding.weight
    owners[id(embedding.weight)].extend(names)


def _token_versions(step_versions: list[int], completion_ids: torch.Tensor, current: int) -> torch.Tensor:
    """(B, L) versions from the per-step list (every row decodes in step; `generate` may run one step past the end and
    undo it, so the first L steps count). Steps not recorded (no decoding) get the current version."""
    num_tokens = completion_ids.size(1)
    steps = (step_versions + [current] * num_tokens)[:num_tokens]
    return torch.tensor(steps, dtype=torch.long).unsqueeze(0).expand(completion_ids.size(0), -1).clone()
