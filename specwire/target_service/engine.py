"""Building the target engine, in the seeds' order:

    model -> resource managers (KV cache, spec) -> drafter -> runner warm-up + graph capture
          -> executor

A drafter may use a resource manager, so managers exist first; a user drafter's own manager
(its `spec_resource_manager`) is registered before the runner warms up.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass

from specwire.common.drafters import NGramDrafter, load_model_drafter
from specwire.common.drafting import check_compatible
from specwire.common.errors import UserError
from specwire.common.model.loader import LoadedModel, load_model
from specwire.common.model.triton_backend import make_backend, make_ops, resolve_exact
from specwire.common.tokenizer import Tokenizer
from specwire.target_service.config import TargetConfig
from specwire.target_service.draft_policy import DraftLengthPolicy
from specwire.target_service.drafters.base import Drafter
from specwire.target_service.drafters.device_ngram import DeviceNGramDrafter
from specwire.target_service.drafters.plugin import load_plugin_drafter
from specwire.target_service.drafters.session import SessionDrafterAdapter
from specwire.target_service.executor import Executor
from specwire.target_service.metrics import TargetMetrics
from specwire.target_service.output import EventQueue, OutputStream, StreamFactory
from specwire.target_service.params import MAX_N, GenerationParams
from specwire.target_service.request import Request, SamplingConfig
from specwire.target_service.resources.base import ResourceRegistry
from specwire.target_service.resources.kv_cache import KVCacheManager
from specwire.target_service.runner.device_drafts import DeviceDrafts
from specwire.target_service.runner.model_runner import ModelRunner, RunnerConfig
from specwire.target_service.scheduler import Scheduler, SchedulerConfig
from specwire.target_service.verifier import Verifier

log = logging.getLogger(__name__)

# max_new_tokens of a request that sets none (generation.proto says so too).
DEFAULT_MAX_NEW_TOKENS = 256


def make_drafter(cfg: TargetConfig, loaded: LoadedModel) -> Drafter | None:
    """The drafter `--drafter` names. `ngram`, `model:NAME` and session plugins are the same
    `SessionDrafter`s the drafter service runs (specwire/common/drafters/), here in-process."""
    spec = cfg.drafter
    if spec == "none" or cfg.max_draft_len == 0:
        return None
    if spec == "ngram" and cfg.draft_on_device:
        return DeviceNGramDrafter(cfg.max_draft_len)
    if spec == "ngram":
        drafter = NGramDrafter(cfg.max_ngram, vote=cfg.ngram_vote)
        return SessionDrafterAdapter(drafter, cfg.max_draft_len)
    if spec.startswith("model:"):
        draft = load_model_drafter(
            spec.removeprefix("model:"),
            device=cfg.device,
            dtype=cfg.torch_dtype,
            num_blocks=cfg.kv_pool_blocks,  # room for as many tokens as the target's cache
            block_size=cfg.block_size,
            max_positions=cfg.max_context_len,
            progress=cfg.progress,
        )
        check_compatible(
            f"--drafter {spec}",
            draft.name,
            draft.vocab_size,
            draft.tokenizer_fingerprint,
            loaded.config.vocab_size,
            loaded.tokenizer.fingerprint,
        )
        return SessionDrafterAdapter(draft, cfg.max_draft_len)
    if spec.startswith("grpc://"):
        from specwire.target_service.drafters.remote import RemoteDrafter
        from specwire.target_service.drafters.remote_channel import RemoteDrafterConfig

        remote = RemoteDrafterConfig(
            spec,
            mode=cfg.drafter_mode,
            deadline_ms=cfg.drafter_deadline_ms,
            patience_ms=cfg.drafter_patience_ms,
            ask_at=cfg.drafter_ask_at,
            wait_rule=cfg.drafter_wait_rule,
            branches_at=cfg.drafter_branches_at,
            max_inflight=cfg.drafter_max_inflight,
            socket=cfg.drafter_socket,
            spin_ms=cfg.drafter_spin_ms,
            startup_wait_s=cfg.drafter_wait_s,
        )
        drafter = RemoteDrafter(
            remote,
            max_draft_len=cfg.max_draft_len,
            vocab_size=loaded.config.vocab_size,
            tokenizer_fingerprint=loaded.tokenizer.fingerprint,
            security=cfg.drafter_security,
            lookahead=cfg.drafter_lookahead,
            branches=cfg.drafter_branches,
        )
        if cfg.pipeline_drafts and drafter.lookahead <= cfg.max_draft_len:
            # A pipelined step drafts past the step in flight (its drafts and bonus token): a
            # proposal of just the drafts asked for never reaches that far.
            log.warning(
                "--pipeline-drafts drafts from the drafter's look-ahead, which is %d tokens"
                " (%s); with less than --max-draft-len + 1 pipelined steps rarely draft: set"
                " --drafter-lookahead",
                drafter.lookahead,
                drafter.info.name,
            )
        return drafter
    if ":" in spec:
        return load_plugin_drafter(spec, cfg.max_draft_len)
    raise UserError(
        f"unknown drafter {spec!r} (use none, ngram, model:NAME, module:Class or grpc://HOST:PORT)"
    )


class Admission:
    """Turning what a client asked for into validated Requests: tokenising, the chat template,
    limits. Shared by the in-process `Engine` and the front end of an engine in its own
    process (`engine_process.EngineProcess`), which answer the properties below."""

    config: TargetConfig

    @property
    def tokenizer(self) -> Tokenizer:
        raise NotImplementedError

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    @property
    def can_draft(self) -> bool:
        """Whether the engine has a drafter."""
        raise NotImplementedError

    @property
    def kv_geometry(self) -> tuple[int, int]:
        """(tokens per KV block, blocks in the pool, the dummy block included)."""
        raise NotImplementedError

    @property
    def max_context_len(self) -> int:
        return self.config.max_context_len

    def new_request(
        self,
        prompt_ids: list[int],
        *,
        max_new_tokens: int | None = None,
        sampling: SamplingConfig | None = None,
        stop: tuple[str, ...] = (),
        ignore_eos: bool = False,
        speculate: bool = True,
        max_draft_len: int | None = None,
        request_id: str = "",
    ) -> Request:
        """Validate inputs and build a Request; raises UserError naming the problem."""
        if not prompt_ids:
            raise UserError("prompt is empty")
        vocab = self.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise UserError(f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        room = self.max_context_len - len(prompt_ids)
        if room < 1:
            raise UserError(
                f"prompt has {len(prompt_ids)} tokens; the context holds {self.max_context_len}"
            )
        if max_new_tokens is None:  # unset: a bounded answer, not "fill the context"
            max_new_tokens = min(DEFAULT_MAX_NEW_TOKENS, room)
        if max_new_tokens < 1:
            raise UserError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if max_new_tokens > room:
            raise UserError(
                f"max_new_tokens {max_new_tokens} + prompt {len(prompt_ids)} tokens exceeds the "
                f"context of {self.max_context_len}"
            )
        k = self.config.max_draft_len if self.can_draft and speculate else 0
        if max_draft_len is not None:
            if max_draft_len < 0:
                raise UserError(f"max_draft_len must be >= 0, got {max_draft_len}")
            k = min(k, max_draft_len)
        # A request that could never hold its KV blocks would wait forever at the queue's head.
        block_size, num_blocks = self.kv_geometry
        need = -(-(len(prompt_ids) + max_new_tokens + k) // block_size)
        if need > num_blocks - 1:  # block 0 is the dummy block
            raise UserError(
                f"prompt {len(prompt_ids)} + max_new_tokens {max_new_tokens} tokens need {need} "
                f"KV blocks; the pool holds {num_blocks - 1}"
            )
        sampling = sampling or SamplingConfig()  # validated where it was built
        return Request(
            request_id=uuid.uuid4().hex,  # internal key: unique whatever the client sends
            client_id=request_id,
            max_context_len=self.max_context_len,
            prompt_ids=list(prompt_ids),
            max_new_tokens=max_new_tokens,
            sampling=sampling,
            stop=tuple(stop),
            ignore_eos=ignore_eos,
            max_draft_len=k,
        )

    def normalize(self, params: GenerationParams) -> list[Request]:
        """Tokenise (or render the chat template), build the sampling config, check limits and
        fan out the n completions (seeds seed + i); raises UserError naming the problem."""
        tok = self.tokenizer
        given = [x is not None for x in (params.prompt, params.prompt_token_ids, params.chat)]
        if sum(given) != 1:
            raise UserError("set exactly one input: prompt, prompt_token_ids or chat")
        if params.prompt is not None:
            if not params.prompt:
                raise UserError("prompt is empty")
            ids = tok.encode(params.prompt)
        elif params.prompt_token_ids is not None:
            ids = list(params.prompt_token_ids)
        else:
            if not params.chat:
                raise UserError("chat has no messages")
            try:
                ids = tok.apply_chat_template(list(params.chat), params.add_generation_prompt)
            except ValueError as exc:
                raise UserError(str(exc)) from exc
        if not 1 <= params.n <= MAX_N:
            raise UserError(f"n must be in 1..{MAX_N}, got {params.n}")
        if not params.logprobs and params.top_logprobs:
            raise UserError("top_logprobs needs logprobs")
        try:
            sampling = SamplingConfig(
                temperature=params.temperature,
                top_k=params.top_k,
                top_p=params.top_p,
                seed=params.seed,
                logprobs=params.top_logprobs if params.logprobs else None,
            )
        except ValueError as exc:
            raise UserError(str(exc)) from exc
        rid = params.request_id or uuid.uuid4().hex
        return [
            self.new_request(
                ids,
                max_new_tokens=params.max_new_tokens,
                sampling=sampling
                if sampling.seed is None
                else dataclasses.replace(sampling, seed=(sampling.seed + i) % 2**64),
                stop=params.stop,
                ignore_eos=params.ignore_eos,
                speculate=params.speculate,
                max_draft_len=params.max_draft_len,
                request_id=rid if params.n == 1 else f"{rid}/{i}",
            )
            for i in range(params.n)
        ]


@dataclass
class Engine(Admission):
    config: TargetConfig
    loaded: LoadedModel
    kv: KVCacheManager
    resources: ResourceRegistry
    drafter: Drafter | None
    runner: ModelRunner
    executor: Executor

    @property
    def tokenizer(self) -> Tokenizer:
        return self.loaded.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.loaded.config.vocab_size

    @property
    def can_draft(self) -> bool:
        return self.drafter is not None

    @property
    def kv_geometry(self) -> tuple[int, int]:
        return self.kv.block_size, self.kv.num_blocks

    def start(self) -> None:
        self.executor.start()

    def cancel(self, request_id: str) -> None:
        self.executor.cancel(request_id)

    def submit(self, requests: list[Request]) -> tuple[EventQueue, list[OutputStream]]:
        """Start a request's completions; their events (tagged with `index`) share one queue.
        Returns the queue and each completion's stream."""
        events = EventQueue()
        factory = self.executor.make_stream
        streams = []
        for i, req in enumerate(requests):
            factory.route(req.request_id, events, i)
            streams.append(self.executor.submit(req))
        return events, streams

    def shutdown(self) -> None:
        self.executor.shutdown()


def build_engine(cfg: TargetConfig, loaded: LoadedModel | None = None) -> Engine:
    # Where the start-up goes, for the ready line (GPU: graph capture and kernel compiles).
    started, phases = time.perf_counter(), {}

    def lap(phase: str) -> None:
        phases[phase] = time.perf_counter() - started - sum(phases.values())

    # 1. model
    if loaded is None:
        loaded = load_model(
            cfg.model,
            device=cfg.device,
            dtype=cfg.torch_dtype,
            block_size=cfg.block_size,
            max_positions=cfg.max_context_len,
            progress=cfg.progress,
        )
    model = loaded.model
    lap("model")
    # 2. resource managers
    k = cfg.max_draft_len if cfg.drafter != "none" else 0
    num_blocks = cfg.kv_pool_blocks
    # The pool first: it refuses a size the memory cannot hold, before the block pool's free
    # list (which an absurd --num-kv-blocks would make exhaust the host) is built.
    kv_caches = model.allocate_kv_cache(num_blocks)
    kv = KVCacheManager(num_blocks, cfg.block_size, k)
    resources = ResourceRegistry()
    resources.add(kv)
    # 3. drafter (may bring its own resource manager)
    drafter = make_drafter(cfg, loaded)
    if drafter is not None and getattr(drafter, "spec_resource_manager", None) is not None:
        resources.add(drafter.spec_resource_manager)
    lap("KV cache and drafter")
    # 4. runner: attention backend, warm-up and graph capture
    model.set_attention(make_backend(cfg.attention, model, kv_caches.device))
    dtype = model.lm_head.weight.dtype
    exact = resolve_exact(cfg.exact, model.attention, dtype, model.gemm_shapes(), cfg.fused)
    model.set_ops(make_ops(model.attention, exact=exact, fused=cfg.fused))
    runner = ModelRunner(
        model,
        kv_caches,
        RunnerConfig(
            max_batch_size=cfg.max_batch_size,
            max_draft_len=k,
            max_context_len=cfg.max_context_len,
            block_size=cfg.block_size,
            dummy_block=KVCacheManager.DUMMY_BLOCK,
            cuda_graphs=cfg.cuda_graphs,
            max_num_tokens=cfg.max_num_tokens,
            pipelined=cfg.pipeline_drafts,
        ),
        device_drafts=DeviceDrafts(
            num_blocks * cfg.block_size,
            cfg.block_size,
            k,
            cfg.max_ngram,
            cfg.ngram_vote,
            kv_caches.device,
        )
        if isinstance(drafter, DeviceNGramDrafter)
        else None,
    )
    runner.warmup(progress=cfg.progress)
    lap("warm-up" + (" and graphs" if runner.graphs is not None else ""))
    # 5. executor
    eos_ids = (
        {loaded.tokenizer.eos_token_id} if loaded.tokenizer.eos_token_id is not None else set()
    )
    # The draft-length policy: adaptive where a measured cost table exists (CUDA graphs).
    # With --pipeline-choice measured it runs each speculative window's drafting steps
    # pipelined or synchronous, whichever measured faster at that load (pipeline_choice.py).
    policy = DraftLengthPolicy(
        k,
        adaptive=cfg.draft_policy == "adaptive",
        pipelined=cfg.pipeline_drafts,
        choose_pipelining=cfg.pipeline_choice == "measured",
    )
    metrics = TargetMetrics(cfg.model)  # streams and the executor report to the same one
    if runner.graphs is not None:
        replay = runner.graphs.measure()
        metrics.one_token_gpu.set(replay[min(replay)])
        policy.seed_costs(replay)
        lap("cost table")
    if runner.graphs is None or k == 0:
        policy.adaptive = False
    executor = Executor(
        scheduler=Scheduler(SchedulerConfig(cfg.max_batch_size, cfg.max_num_tokens, k), kv, policy),
        resources=resources,
        drafter=drafter,
        runner=runner,
        verifier=Verifier(loaded.config.vocab_size),
        make_stream=StreamFactory(
            loaded.tokenizer, eos_ids, cfg.max_context_len, metrics, cfg.stream_interval
        ),
        max_draft_len=k,
        vocab_size=loaded.config.vocab_size,
        metrics=metrics,
        overlap=cfg.overlap,
        two_batch_rows=cfg.two_batch_rows,
        pipelined=cfg.pipeline_drafts,
    )
    lap("executor")
    log.info(
        "engine ready in %.1f s (%s): model=%s device=%s drafter=%s K=%d graphs=%s attention=%s"
        " ops=%s exact=%s policy=%s overlap=%s two-batch-rows=%d draft-on-device=%s"
        " pipeline-drafts=%s%s",
        sum(phases.values()),
        ", ".join(f"{phase} {s:.1f}" for phase, s in phases.items()),
        cfg.model,
        cfg.device,
        cfg.drafter,
        cfg.max_draft_len,
        runner.graphs is not None,
        model.attention.name,
        model.ops.name,
        f"{'on' if exact else 'off'} ({cfg.exact})",
        "adaptive" if policy.adaptive else "static",
        cfg.overlap,
        cfg.two_batch_rows,
        cfg.draft_on_device,
        cfg.pipeline_drafts,
        f" (by load: {cfg.pipeline_choice})" if policy.choice and policy.adaptive else "",
    )
    return Engine(cfg, loaded, kv, resources, drafter, runner, executor)
