"""LoRA versions of one base decoded in one batch on the torch engine (``torch.lora``): every row's
log-probs are those of its own adapter, checked against a teacher-forced pass of real peft models;
base rows mixed in; an adapter evicted from the engine's LRU and read again; the prefix cache never
shares keys and values across adapters; a LoRA version's base is its lineage's declared base."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from loom.contracts.settings import Settings
from loom.contracts.wire import PolicyVersion, RolloutRequest, SamplingParams
from loom.store import PolicyStore
from rollout_svc.engines.base import Completion, PolicyLoadError
from rollout_svc.engines.torch import TorchEngine, teacher_forced_logprobs
from rollout_svc.rollout import generate_group

peft = pytest.importorskip("peft")

# four adapters of four keys: different targets, ranks and scalings (rsLoRA on one)
SPECS: list[dict[str, Any]] = [
    {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
    {"r": 8, "lora_alpha": 16, "target_modules": ["o_proj", "down_proj"]},
    {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "k_proj", "up_proj"]},
    {"r": 4, "lora_alpha": 4, "target_modules": ["v_proj", "gate_proj"], "use_rslora": True},
]
KEYS = ["alice", "bob", "carol", "dave"]


def make_adapter(folder: Path, seed: int, spec: dict[str, Any]) -> Any:
    """A random peft LoRA adapter of the tiny model saved in ``folder`` (B drawn large enough that
    its answers differ from the base's); the peft model itself, the reference, is returned."""
    from zoo.tiny import load_model

    torch.manual_seed(seed)
    model = peft.get_peft_model(load_model(), peft.LoraConfig(**spec))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    model.save_pretrained(str(folder))
    return model.eval()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[Path, Any]]:
    root = tmp_path_factory.mktemp("multilora")
    return [(root / f"a{i}", make_adapter(root / f"a{i}", 10 + i, spec)) for i, spec in enumerate(SPECS)]


@pytest.fixture(scope="module")
def base_model() -> Any:
    from zoo.tiny import load_model

    return load_model().eval()


def ids_of(text: str) -> list[int]:
    from zoo.tiny import load_tokenizer

    return list(load_tokenizer().encode(text, add_special_tokens=False))


def together(engine: TorchEngine, calls: list[tuple[TorchEngine, list[int], SamplingParams]]) -> list[Any]:
    """Submit every call while the engine is held, so the scheduler admits them in one batch."""
    with engine._exclusive():
        futures = [e._submit(list(p), e._fit(p, s, None)) for e, p, s in calls]
    return [f.result(timeout=120) for f in futures]


def assert_own(out: list[Completion], model: Any, prompt: list[int]) -> None:
    for c in out:
        assert c.token_ids, "no token generated"
        ref = teacher_forced_logprobs(model, prompt + c.token_ids, len(prompt))
        assert c.logprobs == pytest.approx(ref, abs=1e-4)


def differs(out: list[Completion], model: Any, prompt: list[int]) -> bool:
    c = out[0]
    ref = teacher_forced_logprobs(model, prompt + c.token_ids, len(prompt))
    return max(abs(a - b) for a, b in zip(c.logprobs, ref, strict=True)) > 1e-2


@pytest.mark.parametrize("max_loras", [8, 2])
def test_four_adapters_and_the_base_decode_in_one_batch_each_row_its_own_adapter(
    adapters: list[tuple[Path, Any]], base_model: Any, max_loras: int
) -> None:
    """4 adapters (2 samples each, sampled at temperature 1) and 2 base requests in one batch: every
    row's log-probs equal its own adapter's peft pass (the base's for base rows), to 1e-4. With an
    LRU of 2, adapters are evicted and read again while the batch runs, and the rows stay exact."""
    from zoo.tiny import CHECKPOINT_DIR

    engine = TorchEngine(CHECKPOINT_DIR, cache_entries=8, max_loras=max_loras)
    views = [engine.adapted_sync(str(folder)) for folder, _ in adapters]
    prompts = [ids_of(p) for p in ("[plain] 3+4", "[plain] 12-5", "[plain] 7*3", "[plain] 9+9")]
    params = SamplingParams(n=2, max_tokens=8, temperature=1.0, seed=5, logprobs=0)
    calls = [(v, prompts[i], params) for i, v in enumerate(views)]
    calls += [(engine, prompts[0], params), (engine, prompts[2], params)]
    got = together(engine, calls)
    assert engine.stats.extra["peak_batch_requests"] == 6  # all six requests in one forward
    for i, (_, ref) in enumerate(adapters):
        assert_own(got[i], ref, prompts[i])
        assert differs(got[i], base_model, prompts[i]), f"adapter {i} answered as the base"
    assert_own(got[4], base_model, prompts[0])
    assert_own(got[5], base_model, prompts[2])
    if max_loras == 2:
        assert len(engine.lora) == 2 and engine.lora.evictions > 0 and engine.lora.loads > 4
    engine.stop_scheduler()


def test_the_prefix_cache_never_shares_keys_and_values_across_adapters(
    adapters: list[tuple[Path, Any]], base_model: Any
) -> None:
    """One prompt served by the base, then by each adapter, then again by each (greedy): an
    adapter's request never reuses the base's or another adapter's cached prefix (its log-probs stay
    its own), and does reuse its own."""
    from zoo.tiny import CHECKPOINT_DIR

    engine = TorchEngine(CHECKPOINT_DIR, cache_entries=16)
    views = [engine.adapted_sync(str(folder)) for folder, _ in adapters]
    prompt = ids_of("[plain] 40+2 and 3+3")
    params = SamplingParams(n=1, max_tokens=4, temperature=0.0, logprobs=0)
    assert_own(engine.generate_sync(prompt, params), base_model, prompt)
    for _ in range(2):
        cached = engine.stats.cached_tokens
        got = together(engine, [(v, prompt, params) for v in views])
        for out, (_, ref) in zip(got, adapters, strict=True):
            assert_own(out, ref, prompt)
    assert cached == 0  # the first round found nothing of the base's to reuse
    assert engine.stats.cached_tokens - cached == 4 * (len(prompt) - 1)  # the second, its own
    engine.stop_scheduler()


def test_an_adapter_view_on_the_single_request_path_and_its_prompt_logprobs(
    adapters: list[tuple[Path, Any]],
) -> None:
    """``batching=False``: a view decodes alone with its adapter; its prompt log-probs are its own."""
    from zoo.tiny import CHECKPOINT_DIR

    engine = TorchEngine(CHECKPOINT_DIR, batching=False)
    folder, ref = adapters[1]
    view = engine.adapted_sync(str(folder))
    prompt = ids_of("[plain] 5+6")
    assert_own(view.generate_sync(prompt, SamplingParams(n=2, max_tokens=6, seed=1, logprobs=0)), ref, prompt)
    scored = view.prompt_logprobs_sync(prompt, 0)
    want = teacher_forced_logprobs(ref, prompt, 1)
    assert [next(iter(d.values()))[0] for d in scored[1:] if d] == pytest.approx(want, abs=1e-4)


@pytest.fixture(scope="module")
def store_world(tmp_path_factory: pytest.TempPathFactory, adapters: list[tuple[Path, Any]]) -> Settings:
    """Each key's namespace holds its adapter as LoRA version 1 (base: the deployment's, version 0);
    eve's version 1 is a LoRA whose lineage started from her full version 3."""
    import shutil

    from zoo.tiny import CHECKPOINT_DIR

    root = tmp_path_factory.mktemp("multilora-store")
    store = PolicyStore(root / "policy")
    for key, (folder, _) in zip(KEYS, adapters, strict=True):
        store.namespace(key).publish(
            1, lambda d, f=folder: shutil.copytree(f, d, dirs_exist_ok=True), kind="lora"
        )
    eve = store.namespace("eve")
    eve.publish(
        1,
        lambda d: shutil.copytree(adapters[0][0], d, dirs_exist_ok=True),
        kind="lora",
        meta={"base_version": 3},
    )
    return Settings(
        data_dir=root / "data", policy_store=store.root, model=str(CHECKPOINT_DIR), torch_threads=1
    )


def request(namespace: str | None, version: int | None) -> RolloutRequest:
    return RolloutRequest.model_validate(
        {
            "prompt_ids": ids_of("[plain] 8+1"),
            "sampling": {"n": 2, "max_tokens": 6, "seed": 3, "temperature": 1.0},
            "policy_version": version,
            "policy_namespace": namespace,
            "policy_match": "exact" if version is not None else "at_least",
        }
    )


@pytest.mark.parametrize("kind", ["torch", "process"])
def test_four_keys_lora_versions_and_the_base_are_served_by_one_replica_at_once(
    store_world: Settings, adapters: list[tuple[Path, Any]], base_model: Any, kind: str
) -> None:
    """Groups of 4 keys' LoRA versions and a base group run together on one engine without a load
    (the engine keeps the base), in process and in the engine's own process (``ProcessEngine``):
    every trajectory carries its own namespace and its own adapter's log-probs."""
    from rollout_svc.engines.process import ProcessEngine
    from zoo.tiny import CHECKPOINT_DIR, load_tokenizer

    engine: Any = (
        TorchEngine(CHECKPOINT_DIR, cache_entries=8) if kind == "torch" else ProcessEngine(CHECKPOINT_DIR)
    )
    tok = load_tokenizer

    async def flow() -> list[Any]:
        reqs = [request(k, 1) for k in KEYS] + [request(None, None)]
        return await asyncio.gather(*(generate_group(r, engine, tok, store_world) for r in reqs))

    groups = asyncio.run(flow())
    assert engine.policy_version == 0 and engine.stats.extra["peak_batch_requests"] >= 2
    refs = [m for _, m in adapters] + [base_model]
    for group, key, ref in zip(groups, [*KEYS, None], refs, strict=True):
        for t in group.trajectories:
            assert (t.policy_namespace, t.policy_version) == (key, 1 if key else 0)
            want = teacher_forced_logprobs(ref, t.prompt_ids + t.completion_ids, len(t.prompt_ids))
            assert t.logprobs == pytest.approx(want, abs=1e-4)
    if kind == "process":
        engine.close_sync()
    else:
        engine.stop_scheduler()


def test_a_lora_whose_declared_base_is_not_the_deployments_is_refused_typed(store_world: Settings) -> None:
    """A LoRA version trained on another base (its lineage's full version 3) is refused with a typed
    error naming that base, never applied to the deployment's base; the merge path refuses it too."""
    from zoo.tiny import CHECKPOINT_DIR

    engine = TorchEngine(CHECKPOINT_DIR)
    with pytest.raises(PolicyLoadError, match="base is version 3"):
        asyncio.run(generate_group(request("eve", 1), engine, lambda: engine.tokenizer, store_world))
    record = PolicyStore(store_world.policy_store_path, create=False).namespace("eve").get(1)
    assert record is not None
    with pytest.raises(PolicyLoadError, match="base is version 3"):
        engine.load_policy_sync(PolicyVersion(**{**record.model_dump(), "namespace": "eve"}))
    assert engine.policy_version == 0
    engine.stop_scheduler()


def test_full_versions_swapped_out_are_kept_in_a_memory_bounded_lru(tmp_path: Path) -> None:
    """A full version loaded again after the base comes from the LRU (no read of its files: they are
    gone), and is served with its own weights, as is the base swapped out before it; with no room,
    nothing is kept."""
    import shutil

    from rollout_svc.engines.torch.versions import model_bytes
    from tests.rollout.conftest import build_model_dir

    base, other = build_model_dir(tmp_path / "base", seed=0), build_model_dir(tmp_path / "v1", seed=7)
    engine = TorchEngine(base, versions_bytes=10 << 30)
    v0 = PolicyVersion(version=0, path=str(base))
    v1 = PolicyVersion(version=1, path=str(other), namespace="alice")
    prompt, params = [5, 6, 7, 8], SamplingParams(n=1, max_tokens=4, temperature=0.0, logprobs=0)
    engine.load_policy_sync(v1)
    want = engine.generate_sync(prompt, params)
    engine.load_policy_sync(v0)  # the base, kept when v1 came in: from the LRU too
    assert len(engine.versions) == 1 and engine.versions.hits == 1  # now v1 is held there
    held = tmp_path / "v1-held"
    shutil.move(str(other), held)  # its files gone: only the LRU can serve it now
    engine.load_policy_sync(v1)
    assert engine.versions.hits == 2 and engine.policy_version == 1
    got = engine.generate_sync(prompt, params)
    assert got[0].token_ids == want[0].token_ids and got[0].logprobs == pytest.approx(want[0].logprobs)
    small = TorchEngine(base, versions_bytes=model_bytes(engine.model) - 1)
    shutil.move(str(held), other)
    small.load_policy_sync(v1)
    small.load_policy_sync(v0)
    assert len(small.versions) == 0  # one model is over the bound: none kept
    engine.stop_scheduler()
    small.stop_scheduler()
