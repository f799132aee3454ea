"""HTTP contract of the inference servers: SGLang's native protocol (docs/inference.md), and registry entries.

Field names are SGLang's own (`python/sglang/srt/managers/io_struct.py`: `GenerateReqInput`,
`UpdateWeightFromDiskReqInput`, `InitWeightsUpdateGroupReqInput`,
`UpdateWeightsFromDistributedReqInput`, `AbortReq`, `PauseGenerationReqInput`; sampling fields
from `sampling/sampling_params.py`), so a client of our `hf` server works unchanged against a real
SGLang server. Our server accepts the subset it implements and refuses the rest with a 400 that
names the field, rather than silently ignoring (say) a `repetition_penalty` it would not apply.

Response of `POST /generate` (one prompt, `n` = 1; a batch or `n` > 1 answers a list of these,
prompt-major):

    {"text": "...", "output_ids": [17, 42, 2],
     "meta_info": {"id": "<rid>", "prompt_tokens": 12, "completion_tokens": 3,
                   "finish_reason": {"type": "stop", "matched": 2},   # or {"type": "length", "length": 3}
                   "output_token_logprobs": [[-0.11, 17, null], [-2.3, 42, null], [-0.01, 2, null]],
                   "weight_version": "4"}}

With `top_logprobs_num: k` (and `return_logprob`), `meta_info.output_top_logprobs` holds, per output
token, the k most likely tokens as `[logprob, token_id, text or null]`, most likely first.

With `logprob_start_len: s` >= 0 (and `return_logprob`), `meta_info.input_token_logprobs` scores the
prompt from position s on, laid out as SGLang does: one `[logprob, token_id, text or null]` per prompt
token `input_ids[s:]`, the first one's logprob null (SGLang's scheduler prepends None), and position
i > s holding `log_softmax(logits[i - 1])[input_ids[i]]` of the raw logits (no temperature), in fp32.
For the prompt [5, 9, 7] and s = 0: `[[null, 5, null], [-3.2, 9, null], [-1.1, 7, null]]`. With k > 0,
`meta_info.input_top_logprobs` has per prompt position null (the first) or its k most likely tokens.
`max_new_tokens: 0` scores the prompt and generates nothing.

`weight_version` is a string, as in SGLang; arl always puts the decimal version number there.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_TOP_LOGPROBS = 20
"""Upper bound of `top_logprobs_num` (OpenAI's `top_logprobs` bound; the cost grows with it)."""
VERIFY_RID_PREFIX = "arl-verify-"
"""`rid` prefix of the trainer's verification probe (prompt scoring, `max_new_tokens` 0): arl's engines run
such a request while generation is paused, so a new version is checked before any request sees it."""
TopLogprobsNum = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]
LogprobStart = Annotated[int, Field(ge=-1)]

# SGLang sampling fields we accept only at their neutral value: a request that sets them expects
# an effect the hf engine does not implement, so it is refused with the field named.
NEUTRAL_SAMPLING_FIELDS: dict[str, Any] = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "regex": None,
    "json_schema": None,
    "ebnf": None,
    "structural_tag": None,
    "logit_bias": None,
    "custom_params": None,
    "stop_regex": None,
}


class _Strict(BaseModel):
    # strict: a JSON `true` is not the token id 1, nor `0` a boolean (lax pydantic would coerce both);
    # integers are still numbers where a float is expected, as in JSON Schema.
    model_config = ConfigDict(extra="forbid", strict=True)


class SamplingParams(_Strict):
    """`sampling_params` of `/generate`, SGLang names and defaults."""

    max_new_tokens: int = Field(default=128, ge=0)
    temperature: float = Field(default=1.0, ge=0.0)
    """0 (or below 1e-6) means greedy, as in SGLang."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = -1
    """-1 = the whole vocabulary."""
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = Field(default=1, ge=1, le=64)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    """Keep a matched stop string in `text` (token ids are never trimmed)."""
    sampling_seed: int | None = None
    """Seed of this request's sampler (reproducible sampling); None = the server's generator."""
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    logit_bias: dict[str, float] | None = None
    custom_params: dict[str, Any] | None = None
    stop_regex: str | list[str] | None = None

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int) -> int:
        if value == 0 or value < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {value}")
        return value

    @model_validator(mode="after")
    def _neutral(self) -> SamplingParams:
        for name, neutral in NEUTRAL_SAMPLING_FIELDS.items():
            if getattr(self, name) != neutral:
                raise ValueError(
                    f"{name}={getattr(self, name)!r} is not supported by the hf engine "
                    f"(only the neutral value {neutral!r}); use an sglang or vllm server for it"
                )
        return self

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]


class GenerateReqInput(_Strict):
    """Body of `POST /generate`. Either `input_ids` or `text`, single or batched."""

    input_ids: list[int] | list[list[int]] | None = None
    text: str | list[str] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    """One `SamplingParams` object for every prompt, or one per prompt (validated per item)."""
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: LogprobStart | list[LogprobStart] = -1
    """With `return_logprob`: the first prompt position of `meta_info.input_token_logprobs` (0: the whole
    prompt; at most the prompt's length); -1: no prompt logprobs (output tokens only)."""
    top_logprobs_num: TopLogprobsNum | list[TopLogprobsNum] = 0
    """With `return_logprob`: the k (0..20) most likely tokens of each output position in
    `meta_info.output_top_logprobs`, from the distribution the token logprobs come from (and of each
    scored prompt position in `meta_info.input_top_logprobs`, from the raw logits)."""
    return_text_in_logprobs: bool = False
    return_routed_experts: bool = False
    """SGLang's: the experts each token was routed to, in `meta_info.routed_experts` (base64 of int32
    `[positions, layers, top_k]` over positions `[routed_experts_start_len, seqlen - 1)`); a mixture-of-experts model
    only."""
    routed_experts_start_len: int = 0
    """The first position of `meta_info.routed_experts` (0: the whole prompt; at most the prompt's length)."""
    stream: bool = False
    session_id: str | None = None
    """Accepted for SGLang compatibility (routing identity); the hf engine does not use it."""
    log_metrics: bool = True
    lora_path: str | list[str | None] | None = None
    """The loaded LoRA adapter (its `lora_name`) that serves the request, one per prompt in a batch; None: the
    base model. SGLang's field (its name, not a path, since adapters are loaded by `/load_lora_adapter`)."""

    @field_validator("top_logprobs_num", mode="before")
    @classmethod
    def _top_bound(cls, value: Any) -> Any:
        # Checked before the type so the message says the bound, not pydantic's union-branch errors.
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, int) and not isinstance(v, bool) and not 0 <= v <= MAX_TOP_LOGPROBS:
                raise ValueError(f"top_logprobs_num must be between 0 and {MAX_TOP_LOGPROBS}, got {v}")
        return value

    @model_validator(mode="after")
    def _one_input(self) -> GenerateReqInput:
        if (self.input_ids is None) == (self.text is None):
            raise ValueError("give exactly one of input_ids (token ids) or text")
        return self

    def is_batch(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, list)
        return bool(self.input_ids) and isinstance(self.input_ids[0], list)  # type: ignore[index]


class AbortReq(_Strict):
    rid: str | None = ""
    abort_all: bool = False
    finished_reason: dict[str, Any] | None = None
    abort_message: str | None = None


class PauseGenerationReqInput(_Strict):
    mode: Literal["abort", "retract", "in_place", "wait"] = "abort"
    """`abort`: finish every running request now with finish_reason abort; `in_place` / `retract`:
    stop decoding and keep requests to continue after `/continue_generation`. `wait` (arl's engines only,
    vLLM's mode of that name; SGLang refuses it): hold new requests, let those in flight finish, answer
    once none runs."""


class UpdateWeightFromDiskReqInput(_Strict):
    model_path: str = Field(min_length=1)
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | int | None = None
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
    flush_cache: bool = True


class InitWeightsUpdateGroupReqInput(_Strict):
    master_address: str = Field(min_length=1)
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    """This server's first rank; rank 0 is the trainer (the broadcast source)."""
    world_size: int = Field(ge=2)
    group_name: str = "weight_update_group"
    backend: Literal["gloo", "nccl"] = "nccl"

    @model_validator(mode="after")
    def _rank_fits(self) -> InitWeightsUpdateGroupReqInput:
        if self.rank_offset >= self.world_size:
            raise ValueError(f"rank_offset {self.rank_offset} must be < world_size {self.world_size}")
        return self


class DestroyWeightsUpdateGroupReqInput(_Strict):
    group_name: str = "weight_update_group"


class BeginWeightUpdateReqInput(_Strict):
    """Opens a weight-update session: `/update_weights_from_distributed` is refused outside one."""

    selector: Literal["target", "draft", "all"] = "all"
    """SGLang's runners the session covers (a draft model for speculative decoding); arl's servers have one."""


class EndWeightUpdateReqInput(_Strict):
    """Closes the session `/begin_weight_update` opened (SGLang's body has no fields)."""


class UpdateWeightsFromDistributedReqInput(_Strict):
    names: list[str] = Field(min_length=1)
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | int | None = None
    load_format: str | None = None

    @model_validator(mode="after")
    def _same_lengths(self) -> UpdateWeightsFromDistributedReqInput:
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ValueError(
                f"names, dtypes and shapes must have equal lengths, got "
                f"{len(self.names)}, {len(self.dtypes)}, {len(self.shapes)}"
            )
        return self


class GetWeightsByNameReqInput(_Strict):
    """Body of `/get_weights_by_name` (GET or POST): the first rows of one parameter, as SGLang answers them.

    The answer is the bare JSON list `param.float().tolist()[:truncate_size]`: the first `truncate_size`
    rows of a matrix (each a list of floats), the first elements of a vector. `name` is the Hugging Face
    parameter name; a tied `lm_head.weight` answers the embedding's rows.
    """

    name: str = Field(min_length=1)
    truncate_size: int = Field(default=100, ge=0)
    """How many rows (elements of a vector) to return; SGLang's default 100."""
    rid: str | None = None
    """Accepted for SGLang compatibility (its request base class carries it); unused."""


LORA_NAME_PREFIX = "arl-lora-v"


def lora_adapter_name(version: int) -> str:
    """The name a LoRA run's version `version` is loaded under (`trainer.lora.publish: adapter`): one per version,
    so a request names the adapter that serves it and a new version never changes an adapter under a request."""
    return f"{LORA_NAME_PREFIX}{version}"


def served_adapter(version: int) -> str | None:
    """The adapter requests of run version `version` name: None for version 0, the base model (a fresh adapter is
    zero, so nothing is loaded for it)."""
    return lora_adapter_name(version) if version > 0 else None


def lora_adapter_version(name: str) -> int | None:
    """The version of an adapter named by `lora_adapter_name` (None for any other name)."""
    tail = name.removeprefix(LORA_NAME_PREFIX)
    return int(tail) if tail != name and tail.isdigit() else None


class LoadLoRAAdapterReqInput(_Strict):
    """Body of `POST /load_lora_adapter` (SGLang's; vLLM's `/v1/load_lora_adapter` takes the first two fields)."""

    lora_name: str = Field(min_length=1)
    """The name requests use (`lora_path` of `/generate`); loading a name already loaded is refused."""
    lora_path: str = Field(min_length=1)
    """A PEFT adapter directory (`adapter_config.json`, `adapter_model.safetensors`) on the server's filesystem."""
    pinned: bool = False
    """SGLang: keep the adapter on the GPU (never evicted); arl's engines never evict one."""
    lora_id: str | None = None
    """SGLang fills this in itself; accepted and unused."""


class UnloadLoRAAdapterReqInput(_Strict):
    """Body of `POST /unload_lora_adapter`: requests already running on it finish first."""

    lora_name: str = Field(min_length=1)
    lora_id: str | None = None


class UpdateWeightVersionReqInput(_Strict):
    """Body of `POST /update_weight_version` (SGLang's): relabel the served weights without touching them, what a
    LoRA publication does once the new adapter is loaded."""

    new_version: str | int
    abort_all_requests: bool = True


class InferenceEntry(BaseModel):
    """`registry/inference/<server>.json`: one running inference server (written by `stages.inference`).

    Example: {"url": "http://10.0.0.5:30001", "backend": "hf", "model_path": "/runs/x/checkpoints/step_000003",
    "weight_version": 3, "host": "node17", "pid": 4242, "started_at": 1795000000.0, "tp_size": 1, "attempt": 2}
    """

    model_config = ConfigDict(extra="ignore")  # newer writers may add fields; readers keep working

    url: str
    backend: Literal["hf", "vllm", "sglang"]
    model_path: str
    weight_version: int = Field(ge=0)
    """Version the server loaded at start (later updates are reported as `weight_version` by `/model_info`)."""
    host: str
    pid: int
    started_at: float
    """Epoch seconds."""
    tp_size: int = Field(default=1, ge=1)
    attempt: int | None = Field(default=None, ge=1)
    """The inference stage attempt that started the server (None: written before arl recorded it). A newer
    attempt retires the entries of older ones at its start: their stage ended, so nothing supervises them."""
    routable: bool = True
    """False while a restarted server holds an older version than the announced one: the trainer's next
    publication brings it up to date (it takes part in weight swaps) but no request is routed to it; the
    inference stage sets it True once the server verified the announced version."""
