"""Building the target engine, in the seeds' order:

    model -> resource managers (KV cache, spec) -> drafter -> runner warm-up + graph capture
          -> executor

A drafter may use a resource manager, so managers exist first; a user drafter's own manager
(its `spec_resource_manager`) is registered before the runner warms up.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass

from common.errors import UserError
from common.model.loader import LoadedModel, load_model
from target_service.config import TargetConfig
from target_service.drafters.base import Drafter
from target_service.drafters.ngram import NGramDrafter
from target_service.drafters.plugin import load_plugin_drafter
from target_service.executor import Executor
from target_service.output import OutputStream
from target_service.request import Request, SamplingConfig
from target_service.resources.base import ResourceRegistry
from target_service.resources.kv_cache import KVCacheManager
from target_service.runner.model_runner import ModelRunner, RunnerConfig
from target_service.scheduler import Scheduler, SchedulerConfig
from target_service.verifier import Verifier

log = logging.getLogger(__name__)

# max_new_tokens of a request that sets none (generation.proto says so too).
DEFAULT_MAX_NEW_TOKENS = 256


def make_drafter(cfg: TargetConfig, loaded: LoadedModel) -> Drafter | None:
    spec = cfg.drafter
    if spec == "none" or cfg.max_draft_len == 0:
        return None
    if spec == "ngram":
        return NGramDrafter(cfg.max_draft_len, cfg.max_ngram)
    if spec.startswith("grpc://"):
        from target_service.drafters.remote import RemoteDrafter

        return RemoteDrafter(
            spec.removeprefix("grpc://"),
            max_draft_len=cfg.max_draft_len,
            vocab_size=loaded.config.vocab_size,
            tokenizer_fingerprint=loaded.tokenizer.fingerprint,
            mode=cfg.drafter_mode,
            deadline_ms=cfg.drafter_deadline_ms,
        )
    if ":" in spec:
        return load_plugin_drafter(spec, cfg.max_draft_len)
    raise UserError(f"unknown drafter {spec!r} (use none, ngram, module:Class or grpc://HOST:PORT)")


@dataclass
class Engine:
    config: TargetConfig
    loaded: LoadedModel
    kv: KVCacheManager
    resources: ResourceRegistry
    drafter: Drafter | None
    runner: ModelRunner
    executor: Executor

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
        vocab = self.loaded.config.vocab_size
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
        k = self.config.max_draft_len if self.drafter is not None and speculate else 0
        if max_draft_len is not None:
            if max_draft_len < 0:
                raise UserError(f"max_draft_len must be >= 0, got {max_draft_len}")
            k = min(k, max_draft_len)
        sampling = sampling or SamplingConfig()  # validated where it was built
        return Request(
            request_id=request_id or uuid.uuid4().hex,
            prompt_ids=list(prompt_ids),
            max_new_tokens=max_new_tokens,
            sampling=sampling,
            stop=tuple(stop),
            ignore_eos=ignore_eos,
            max_draft_len=k,
        )

    def shutdown(self) -> None:
        self.executor.shutdown()


def build_engine(cfg: TargetConfig, loaded: LoadedModel | None = None) -> Engine:
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
    # 2. resource managers
    k = cfg.max_draft_len if cfg.drafter != "none" else 0
    num_blocks = cfg.num_kv_blocks or (cfg.max_batch_size * cfg.blocks_per_seq + 1)
    kv = KVCacheManager(num_blocks, cfg.block_size, k)
    resources = ResourceRegistry()
    resources.add(kv)
    kv_caches = model.allocate_kv_cache(num_blocks)
    # 3. drafter (may bring its own resource manager)
    drafter = make_drafter(cfg, loaded)
    if drafter is not None and getattr(drafter, "spec_resource_manager", None) is not None:
        resources.add(drafter.spec_resource_manager)
    # 4. runner: warm-up and graph capture
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
        ),
    )
    runner.warmup(progress=cfg.progress)
    # 5. executor
    eos_ids = (
        {loaded.tokenizer.eos_token_id} if loaded.tokenizer.eos_token_id is not None else set()
    )
    executor = Executor(
        scheduler=Scheduler(SchedulerConfig(cfg.max_batch_size, cfg.max_num_tokens, k), kv),
        resources=resources,
        drafter=drafter,
        runner=runner,
        verifier=Verifier(loaded.config.vocab_size),
        make_stream=lambda req: OutputStream(req, loaded.tokenizer, eos_ids, cfg.max_context_len),
        max_draft_len=k,
        vocab_size=loaded.config.vocab_size,
    )
    log.info(
        "engine ready: model=%s device=%s drafter=%s K=%d graphs=%s",
        cfg.model,
        cfg.device,
        cfg.drafter,
        cfg.max_draft_len,
        runner.graphs is not None,
    )
    return Engine(cfg, loaded, kv, resources, drafter, runner, executor)
