"""Users' own checkpoints, exact or refused (loom/architectures.py, docs/models.md "Your own
checkpoints"): small random-weight models of nine architectures built from transformers' own config
classes (hidden 64, 2 layers, 4 heads / 2 KV heads, Loom's tokenizer), sequences longer than the
sliding windows (16) and rows of different lengths sharing a batch, then a second batch on the
scheduler's reused static KV. Each path against transformers itself: the engine's greedy tokens
against a greedy loop of full forwards, its log-probs and the learner's recomputed ones (padded,
packed, segment attention, the fused head) against a teacher-forced float32 eager pass, FCI scores
against the eager attention maps; or the path refuses the model with ``UnsupportedModel``."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch

from loom.architectures import UnsupportedModel, attention_of
from loom.contracts.wire import SamplingParams, Trajectory
from loom.fci import fci_scores, fci_scores_eager
from loom.runtime import configure_process
from zoo.tiny import CHECKPOINT_DIR
from zoo.tiny import load_tokenizer as tiny_tokenizer

ATOL = 1e-4
WINDOW = 16
COMMON = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}


def config_of(name: str, vocab: int) -> Any:
    import transformers as tf

    c = {**COMMON, "vocab_size": vocab}
    moe = {"moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2}
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    return {
        "qwen2": lambda: tf.Qwen2Config(**c),
        "qwen3": lambda: tf.Qwen3Config(**c, head_dim=16),
        "llama3": lambda: tf.LlamaConfig(**c, rope_scaling={**rope, "original_max_position_embeddings": 32}),
        "mistral": lambda: tf.MistralConfig(**c, sliding_window=WINDOW),
        "phi3": lambda: tf.Phi3Config(**c),
        "gemma": lambda: tf.GemmaConfig(**c, head_dim=16),
        "gemma2": lambda: tf.Gemma2Config(**c, head_dim=16, sliding_window=WINDOW),
        "gemma3": lambda: tf.Gemma3TextConfig(
            **c, head_dim=16, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]
        ),
        "qwen2_sliding": lambda: tf.Qwen2Config(
            **c, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
        ),
        "qwen2_moe": lambda: tf.Qwen2MoeConfig(**c, **moe, shared_expert_intermediate_size=32),
        "qwen3_moe": lambda: tf.Qwen3MoeConfig(**c, **moe, head_dim=16),
    }[name]()


NAMES = [
    "qwen2",
    "qwen3",
    "llama3",
    "mistral",
    "phi3",
    "gemma",
    "gemma2",
    "gemma3",
    "qwen2_sliding",
    "qwen2_moe",
    "qwen3_moe",
]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return tiny_tokenizer()


_built: dict[str, Path] = {}


def checkpoint(name: str, root: Path, tokenizer: Any) -> Path:
    """The random-weight checkpoint ``name`` (built once per session), with Loom's tokenizer."""
    if name not in _built:
        from transformers import AutoModelForCausalLM

        configure_process()
        torch.manual_seed(0)
        cfg = config_of(name, len(tokenizer))
        cfg.eos_token_id = tokenizer.eos_token_id
        cfg.pad_token_id = tokenizer.pad_token_id
        cfg.bos_token_id = tokenizer.bos_token_id
        model = AutoModelForCausalLM.from_config(cfg)
        with torch.no_grad():  # larger weights than the init's: logits far from uniform, ties unlikely
            for p in model.parameters():
                if p.dim() > 1:
                    p.normal_(0.0, 0.15)
        path = root / name
        model.save_pretrained(str(path))
        tokenizer.save_pretrained(str(path))
        _built[name] = path
    return _built[name]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(tmp_path_factory.mktemp("archs"))


def reference(path: Path) -> Any:
    """transformers' own model, eager attention, float32: the reference every path is held to."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager"
    ).eval()


@torch.no_grad()
def forced(model: Any, ids: list[int], start: int) -> list[float]:
    logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return [logp[i - 1, ids[i]].item() for i in range(start, len(ids))]


@torch.no_grad()
def greedy(model: Any, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    for _ in range(n):
        out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids) :]


def prompts(tokenizer: Any, lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    special = set(tokenizer.all_special_ids)
    pool = [i for i in range(len(tokenizer)) if i not in special]
    return [[pool[int(i)] for i in torch.randint(len(pool), (n,), generator=g)] for n in lengths]


def together(engine: Any, calls: list[tuple[list[int], SamplingParams]]) -> list[Any]:
    """The calls submitted while the scheduler is held: they share one batch."""
    with engine._exclusive():
        futures: list[Future[Any]] = [engine._submit(ids, p) for ids, p in calls]
    return [f.result(timeout=120) for f in futures]


# ------------------------------------------------------------------------------------------------
# the engine


@pytest.mark.parametrize("name", NAMES)
def test_engine_greedy_and_logprobs_match_transformers(name: str, root: Path, tokenizer: Any) -> None:
    from rollout_svc.engines.torch import TorchEngine

    path = checkpoint(name, root, tokenizer)
    ref = reference(path)
    engine = TorchEngine(path, cache_entries=8)
    single = TorchEngine(path, model=engine.model, tokenizer=engine.tokenizer, batching=False)
    n = 20
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=0)
    first = prompts(tokenizer, [5, 19, 11], seed=1)  # rows of different lengths, past the window
    second = prompts(tokenizer, [30, 3], seed=2)  # wider than the first batch: the reused KV moves
    try:
        for batch, mode in ((first, "eager"), (second, "static")):  # static: what CUDA graphs hold
            engine.scheduler.decode.mode = mode  # type: ignore[assignment]
            got = together(engine, [(ids, params) for ids in batch])
            for ids, outs in zip(batch, got, strict=True):
                want = greedy(ref, ids, n)
                assert outs[0].token_ids == want
                assert outs[0].logprobs == pytest.approx(forced(ref, ids + want, len(ids)), abs=ATOL)
        alone = single.generate_sync(second[0], params)[0]
        assert alone.token_ids == greedy(ref, second[0], n)
        # past a cached prefix (a finished row's entry): prefilled on top of the reused keys
        longer = second[0] + alone.token_ids[:10] + prompts(tokenizer, [4], seed=6)[0]
        again = engine.generate_sync(longer, params)[0]
        assert again.cached_tokens >= len(second[0]) + 10
        assert again.token_ids == greedy(ref, longer, n)
        assert again.logprobs == pytest.approx(forced(ref, longer + again.token_ids, len(longer)), abs=ATOL)
    finally:
        engine.stop_scheduler()
        single.stop_scheduler()


@pytest.mark.parametrize("name", ["mistral", "gemma3", "llama3"])
def test_the_group_layout_is_exact_or_refused_on_windows(name: str, root: Path, tokenizer: Any) -> None:
    """StreamingThinker's group layout has no contiguous key sequence for a window to slide over:
    a windowed model refuses it (engine, teacher-forced pass); a full-attention one stays exact."""
    from rollout_svc.engines.base import Layout, UnsupportedCapability
    from rollout_svc.engines.torch import TorchEngine, teacher_forced_logprobs

    path = checkpoint(name, root, tokenizer)
    engine = TorchEngine(path, cache_entries=4, batching=False)
    ids = prompts(tokenizer, [24], seed=3)[0]
    layout = Layout(groups=[0] * 8 + [1] * 8 + [2] * 8, gen_group=3)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    try:
        if attention_of(engine.model.config).windowed:
            assert "group_positions" not in engine.capabilities
            with pytest.raises(UnsupportedCapability, match="sliding-window"):
                engine.generate_sync(ids, params, layout)
            with pytest.raises(UnsupportedModel, match="group layout"):
                teacher_forced_logprobs(engine.model, ids + [ids[0]], len(ids), layout)
        else:
            out = engine.generate_sync(ids, params, layout)[0]
            ref = teacher_forced_logprobs(reference(path), ids + out.token_ids, len(ids), layout)
            assert out.logprobs == pytest.approx(ref, abs=ATOL)
    finally:
        engine.stop_scheduler()


def test_layer_types_declare_windows_only_with_a_window() -> None:
    """Per-layer windows come from ``layer_types`` and the one ``sliding_window`` (Gemma3, Qwen2);
    without a window every layer is full, whatever the layer types say."""
    cfg = config_of("gemma3", 600)
    cfg.layer_types = ["sliding_attention", "sliding_attention"]
    assert attention_of(cfg).windows == (WINDOW, WINDOW)
    cfg.sliding_window = None  # no window: every layer full, whatever the layer types say
    assert not attention_of(cfg).windowed


def test_an_unknown_architecture_is_refused_at_load(root: Path, tokenizer: Any) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    from rollout_svc.engines.torch import TorchEngine

    path = root / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=len(tokenizer))).save_pretrained(
        path
    )
    with pytest.raises(UnsupportedModel, match="'gpt2'.*supported architectures"):
        TorchEngine(path, tokenizer=tokenizer)


# ------------------------------------------------------------------------------------------------
# the learner


def trajectories(tokenizer: Any) -> list[Trajectory]:
    """Prompt + completion lengths from 9 to 45 tokens: most past the window, several per packed row."""
    sizes = [(5, 20), (19, 26), (3, 6), (12, 30), (7, 9)]
    ids = prompts(tokenizer, [p + c for p, c in sizes], seed=4)
    return [
        Trajectory(id=f"t{i}", group_id="g", prompt_ids=x[:p], completion_ids=x[p:])
        for i, ((p, _), x) in enumerate(zip(sizes, ids, strict=True))
    ]


LEARNER_PATHS = {  # learner.logprobs.recompute's layouts, each attention it picks
    "padded": {"packing": False},
    "packed": {"packing": True, "segment_attention": False},
    "segments": {"packing": True, "segment_attention": True},
    "fused_head": {"packing": True, "segment_attention": True, "chunk": 16},
}


@pytest.mark.parametrize("name", NAMES)
def test_learner_recompute_matches_transformers(name: str, root: Path, tokenizer: Any) -> None:
    from learner.logprobs import recompute
    from learner.train import _load_causal_lm

    path = checkpoint(name, root, tokenizer)
    ref = reference(path)
    model = _load_causal_lm(path).eval()
    trajs = trajectories(tokenizer)
    want = [forced(ref, t.prompt_ids + t.completion_ids, len(t.prompt_ids)) for t in trajs]
    for how, kwargs in LEARNER_PATHS.items():
        with torch.no_grad():
            out = recompute(model, trajs, token_budget=96, **kwargs)  # type: ignore[arg-type]
        assert any(len(mb.index) > 1 for mb in out), how  # rows of different lengths together
        for mb in out:
            for r, k in enumerate(mb.index):
                n = len(trajs[k].completion_ids)
                assert mb.logp[r, :n].tolist() == pytest.approx(want[k], abs=ATOL), (how, k)


def test_the_learner_refuses_a_group_layout_on_a_window(root: Path, tokenizer: Any) -> None:
    from learner.logprobs import recompute
    from learner.train import _load_causal_lm

    model = _load_causal_lm(checkpoint("mistral", root, tokenizer))
    t = trajectories(tokenizer)[0]
    from learner.logprobs import GROUP_LAYOUT

    grouped = t.model_copy(update={"meta": {"layout": GROUP_LAYOUT, "completion_groups": [1] * 20}})
    with pytest.raises(UnsupportedModel, match="group layout"):
        recompute(model, [grouped])


# ------------------------------------------------------------------------------------------------
# FCI


@pytest.mark.parametrize("name", NAMES)
def test_fci_scores_match_the_eager_attention_maps(name: str, root: Path, tokenizer: Any) -> None:
    from rollout_svc.engines.torch import load_model

    model = load_model(checkpoint(name, root, tokenizer))
    ids = prompts(tokenizer, [48], seed=5)[0]
    steps = [(0, 6), (6, 14), (14, 20), (20, 29), (29, 35), (35, 42), (42, 48)]
    got = fci_scores(model, ids, steps, delta=1, block=8)
    want = fci_scores_eager(model, ids, steps, delta=1)
    assert any(v > 0 for v in want)
    assert got == pytest.approx(want, abs=ATOL)


# ------------------------------------------------------------------------------------------------
# LoRA targets


@pytest.mark.parametrize(("name", "fused"), [("phi3", True), ("qwen2", False)])
def test_lora_targets_resolve_per_architecture(name: str, fused: bool, root: Path, tokenizer: Any) -> None:
    """The default targets (q, k, v, o) adapt Phi3's fused qkv_proj, not o_proj alone; a target that
    names no layer is refused before training."""
    pytest.importorskip("peft")
    from learner.config import LearnerSettings
    from learner.train import Learner

    path = checkpoint(name, root, tokenizer)
    cfg = LearnerSettings(model=str(path), store=root / f"store-{name}", lora_rank=4, device="cpu")
    learner = Learner(cfg)
    adapted = {n.rsplit(".", 1)[-1] for n, m in learner.model.named_modules() if hasattr(m, "lora_A")}
    assert adapted == ({"qkv_proj", "o_proj"} if fused else {"q_proj", "k_proj", "v_proj", "o_proj"})
    with pytest.raises(UnsupportedModel, match="'w_pack' matches no layer"):
        Learner(cfg.model_copy(update={"lora_targets": ("q_proj", "w_pack")}))


def test_the_models_doc_lists_every_supported_architecture() -> None:
    from loom.architectures import ARCHITECTURES

    doc = (Path(__file__).resolve().parents[1] / "docs" / "models.md").read_text()
    section = doc.split("## Your own checkpoints", 1)[1]
    rows = [line.split("|")[1].strip().strip("`") for line in section.splitlines() if line.startswith("| `")]
    assert sorted(rows) == sorted(ARCHITECTURES) and len(rows) == len(set(rows))


# ------------------------------------------------------------------------------------------------
# dtype


def test_auto_dtype_is_the_checkpoints_own_on_cuda_and_float32_on_cpu() -> None:
    from transformers import LlamaConfig

    from loom.architectures import resolve_dtype

    saved = LlamaConfig(dtype="bfloat16")
    assert resolve_dtype("auto", saved, "cuda:0") == "bfloat16"
    assert resolve_dtype("auto", saved, "cpu") == "float32"
    assert resolve_dtype("auto", LlamaConfig(), "cuda") == "float32"  # nothing recorded: float32
    assert resolve_dtype("float16", saved, "cpu") == "float16"
    with pytest.raises(ValueError, match="int8"):
        resolve_dtype("int8", saved, "cpu")


def test_a_bf16_checkpoint_loads_in_bf16_where_asked(root: Path, tokenizer: Any) -> None:
    """LOOM_ENGINE_DTYPE reaches the engine the services build (``make_engine``) and
    LOOM_LEARNER_DTYPE the learner; bf16 log-probs stay within docs/benchmarks/engine.md's bf16 bounds
    of the float32 teacher-forced pass (mean < 0.01, max < 0.6)."""
    from transformers import AutoModelForCausalLM

    from learner.config import LearnerSettings
    from learner.logprobs import recompute
    from learner.train import Learner
    from loom.contracts.settings import Settings
    from rollout_svc.engines import make_engine
    from zoo.tiny import make_problems
    from zoo.tiny.traces import plain_prompt

    path = root / "tiny-bf16"  # the tiny checkpoint, where the bf16 bounds were measured
    AutoModelForCausalLM.from_pretrained(str(CHECKPOINT_DIR), dtype=torch.bfloat16).save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    ref = reference(path)  # the same bf16-saved weights, in float32
    auto = make_engine(Settings(model=str(path), engine_dtype="auto", device="cpu", engine_process=False))
    assert auto.dtype == "float32"  # type: ignore[attr-defined]
    engine = make_engine(
        Settings(model=str(path), engine_dtype="bfloat16", device="cpu", engine_process=False)
    )
    assert engine.dtype == "bfloat16" and next(engine.model.parameters()).dtype == torch.bfloat16  # type: ignore[attr-defined]
    ids = tokenizer.encode(plain_prompt(make_problems("countdown", 1, seed=3)[0]), add_special_tokens=False)
    params = SamplingParams(max_tokens=64, n=4, temperature=1.0, seed=0, logprobs=0)
    outs = engine.generate_sync(ids, params)  # type: ignore[attr-defined]
    d = [
        abs(a - b)
        for o in outs
        for a, b in zip(o.logprobs, forced(ref, ids + o.token_ids, len(ids)), strict=True)
    ]
    assert sum(d) / len(d) < 0.01 and max(d) < 0.6
    for e in (auto, engine):
        e.stop_scheduler()  # type: ignore[attr-defined]

    learner = Learner(
        LearnerSettings(model=str(path), store=root / "store-bf16", dtype="bfloat16", device="cpu")
    )
    assert next(learner.model.parameters()).dtype == torch.bfloat16
    trajs = [
        Trajectory(id=str(i), group_id="g", prompt_ids=ids, completion_ids=o.token_ids)
        for i, o in enumerate(outs)
    ]
    with torch.no_grad():
        (mb,) = recompute(learner.model.eval(), trajs, token_budget=4096, packing=True, chunk=16)
    d = []
    for r, k in enumerate(mb.index):
        t = trajs[k]
        want = forced(ref, t.prompt_ids + t.completion_ids, len(t.prompt_ids))
        d += [abs(a - b) for a, b in zip(mb.logp[r, : len(want)].tolist(), want, strict=True)]
    assert sum(d) / len(d) < 0.01 and max(d) < 0.6
    float32 = Learner(LearnerSettings(model=str(path), store=root / "store-f32", device="cpu"))
    assert next(float32.model.parameters()).dtype == torch.float32  # the default keeps float32 weights


# ------------------------------------------------------------------------------------------------
# a learner step and the reload


@pytest.mark.parametrize("name", ["mistral", "gemma2", "gemma3"])
def test_a_learner_step_and_the_engines_reload_stay_exact(name: str, root: Path, tokenizer: Any) -> None:
    """Engine samples past the window, a learner step on them (its recompute equal to the engine's
    log-probs: the mismatch metric reads what both are, since both are held to transformers above),
    the published version reloaded by the engine: greedy tokens equal transformers' on it."""
    from learner.config import LearnerSettings
    from learner.train import Learner
    from loom.contracts.wire import Group, LossSpec, RewardResult, TrainBatch, TrajectoryReward
    from rollout_svc.engines.torch import TorchEngine

    path = checkpoint(name, root, tokenizer)
    engine = TorchEngine(path, cache_entries=4)
    groups, results = [], []
    batch = prompts(tokenizer, [12, 17], seed=8)  # one batch, rows of two lengths, past the window
    calls = [
        (ids, SamplingParams(max_tokens=16, n=4, temperature=1.0, seed=g, ignore_eos=True, logprobs=0))
        for g, ids in enumerate(batch)
    ]
    for gi, (ids, outs) in enumerate(zip(batch, together(engine, calls), strict=True)):
        trajs = [
            Trajectory(
                id=f"{gi}-{i}",
                group_id=str(gi),
                prompt_ids=ids,
                completion_ids=c.token_ids,
                logprobs=c.logprobs,
            )
            for i, c in enumerate(outs)
        ]
        groups.append(Group(id=str(gi), trajectories=trajs))
        rewards = [TrajectoryReward(trajectory_id=t.id, total=float(i % 2)) for i, t in enumerate(trajs)]
        results.append(RewardResult(group_id=str(gi), rewards=rewards))
    learner = Learner(LearnerSettings(model=str(path), store=root / f"store-step-{name}", device="cpu"))
    step = learner.train_step(TrainBatch(step=0, groups=groups, rewards=results, loss=LossSpec(lr=1e-2)))
    assert step.metrics["logprob_mismatch_max"] < ATOL
    assert step.policy is not None and step.policy_version == 1
    engine.load_policy_sync(step.policy)
    ids = prompts(tokenizer, [21], seed=9)[0]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
    trained = reference(Path(step.policy.path))
    out = engine.generate_sync(ids, params)[0]
    assert out.token_ids == greedy(trained, ids, 12)
    assert out.logprobs == pytest.approx(forced(trained, ids + out.token_ids, len(ids)), abs=ATOL)
    assert out.logprobs != pytest.approx(forced(reference(path), ids + out.token_ids, len(ids)), abs=ATOL)
    engine.stop_scheduler()


# ------------------------------------------------------------------------------------------------
# streaming rollouts


def streaming_request(layout: str) -> Any:
    from loom.contracts.wire import RolloutRequest

    return RolloutRequest(
        group_id="g-stream",
        mode="streaming",
        prompt="[stream]",
        sampling=SamplingParams(n=2, max_tokens=8, seed=9, temperature=1.0),
        mode_params={"sentences": ["we have 3 and 4.", "add them."], "layout": layout, "segment_cap": 6},
    )


def test_streaming_is_exact_or_refused_by_name(root: Path, tokenizer: Any) -> None:
    """Interleaved streaming on a windowed model is an ordinary sequence (exact); its group layout is
    refused by the engine (``UnsupportedCapability``); a tokenizer that cannot write a trace marker
    (a word-level one that reads it as its unknown token) is refused by the mode, naming the marker.
    (A tokenizer that writes a marker in several tokens streams: tests/rollout_modes/test_markers.py.)"""
    import asyncio

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from loom.contracts.settings import Settings
    from rollout_svc.engines.base import UnsupportedCapability
    from rollout_svc.engines.torch import TorchEngine
    from rollout_svc.modes import ModeError
    from rollout_svc.rollout import generate_group

    path = checkpoint("mistral", root, tokenizer)
    ref = reference(path)
    engine = TorchEngine(path, cache_entries=8)

    def run(layout: str, tok: Any) -> Any:
        return asyncio.run(generate_group(streaming_request(layout), engine, lambda: tok, Settings()))

    try:
        group = run("interleaved", tokenizer)
        for t in group.trajectories:
            ids = t.prompt_ids + t.completion_ids
            assert len(ids) > WINDOW
            want = forced(ref, ids, len(t.prompt_ids))
            trained = [i for i, m in enumerate(t.loss_mask or []) if m]
            assert [t.logprobs[i] for i in trained] == pytest.approx([want[i] for i in trained], abs=ATOL)
        with pytest.raises(UnsupportedCapability, match="sliding-window"):
            run("group_positions", tokenizer)
        words = ["<|im_start|>", "<|im_end|>", "[stream]", "we", "have", "add", "them."]
        chatml = PreTrainedTokenizerFast(
            tokenizer_object=_word_level(Tokenizer, models, pre_tokenizers, words),
            unk_token="[UNK]",
            eos_token="<|im_end|>",
        )
        with pytest.raises(ModeError, match="cannot write the marker '<EOT>'"):
            run("interleaved", chatml)
    finally:
        engine.stop_scheduler()


def _word_level(tokenizer_cls: Any, models: Any, pre_tokenizers: Any, words: list[str]) -> Any:
    tok = tokenizer_cls(models.WordLevel({w: i for i, w in enumerate(["[UNK]", *words])}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the captured decode step)")
@pytest.mark.parametrize("name", ["mistral", "gemma2", "gemma3"])
def test_the_window_holds_in_cuda_graphs(name: str, root: Path, tokenizer: Any) -> None:
    """The captured static step computes its window from the device column (``kv.col``): rows of
    different lengths past the window, replayed, within 2e-4 of the CPU float32 pass."""
    from rollout_svc.engines.torch import TorchEngine

    path = checkpoint(name, root, tokenizer)
    ref = reference(path)
    engine = TorchEngine(path, device="cuda", cache_entries=4, cuda_graphs=True)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=0)
    batch = prompts(tokenizer, [5, 19, 11, 30], seed=10)
    try:
        got = together(engine, [(ids, params) for ids in batch])
        decode = engine.scheduler.decode
        assert decode.graph_error is None and decode.replays >= 10, decode.graph_error
        for ids, outs in zip(batch, got, strict=True):
            c = outs[0]
            assert c.logprobs == pytest.approx(forced(ref, ids + c.token_ids, len(ids)), abs=2e-4)
    finally:
        engine.stop_scheduler()
