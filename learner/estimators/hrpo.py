"""HRPO (AdaSR eq. 8; docs/algorithms.md §5.1-5.2): component-wise advantages A^s, A^d, A^g, and
their tokens: A^s on the trained tokens inside ``stream`` segments (the streaming phase |t_s| of
AdaSR eq. 4-5), A^d on every other trained token (deep reasoning and answer, the interval
(|t_s|, |o|]), A^g on every trained token."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torch import Tensor

from learner.estimators.common import (
    TokenAdvantages,
    group_normalize,
    kind_mask,
    reward_of,
    trained_mask,
    uniform,
)
from learner.losses import LossParts, LossTerms, hrpo_loss, pad_rows
from loom.contracts.estimators import EPS, HrpoNames, HrpoParams
from loom.contracts.wire import Group, LossSpec, TrajectoryReward

_DEFAULT = HrpoParams()


@dataclass(frozen=True)
class HrpoAdvantage:
    """A^s, A^d, A^g of one trajectory (``adv_stream``, ``adv_deep``, ``adv_global``)."""

    adv_stream: float
    adv_deep: float
    adv_global: float


def _masked_normalize(x: Sequence[float], valid: Sequence[bool], eps: float) -> list[float]:
    """N_G over the valid members only; invalid members get 0 (format masking, AdaSR appendix C)."""
    idx = [i for i, ok in enumerate(valid) if ok]
    normed = group_normalize([x[i] for i in idx], eps=eps)
    out = [0.0] * len(x)
    for i, v in zip(idx, normed, strict=True):
        out[i] = v
    return out


def hrpo(
    components: Sequence[Mapping[str, float]],
    *,
    beta: float = _DEFAULT.beta,
    w_acc: float = _DEFAULT.w_acc,
    w_fmt: float = _DEFAULT.w_fmt,
    mask_length_by_format: bool = _DEFAULT.mask_length_by_format,
    names: HrpoNames = _DEFAULT.names,
    eps: float = EPS,
) -> list[HrpoAdvantage]:
    """HRPO component-wise advantages (AdaSR eq. 8), beta applied AFTER normalisation (appendix C):

        A^s = w_fmt N_G(R_fmt^s) + beta N_G(R^{Ls})
        A^d = w_fmt N_G(R_fmt^d) + beta N_G(R^{Ld})
        A^g = w_acc N_G(R_acc)   + beta N_G(R_eff)

    ``w_acc``/``w_fmt`` are AdaSR Table 6's accuracy/format coefficients (1 and 2), multiplying the
    normalised component advantages. With ``mask_length_by_format`` the length penalties are
    normalised over the format-valid members only and invalid members get 0 for that term
    (length is not gated by accuracy; format validity is handled at advantage time, appendix C).
    A missing component counts as 0 for every member (so it contributes nothing).
    """

    def col(name: str) -> list[float]:
        return [float(c.get(name, 0.0)) for c in components]

    fmt_s, fmt_d = col(names.format_stream), col(names.format_deep)
    len_s, len_d = col(names.length_stream), col(names.length_deep)
    if mask_length_by_format:
        n_len_s = _masked_normalize(len_s, [f > 0.5 for f in fmt_s], eps)
        n_len_d = _masked_normalize(len_d, [f > 0.5 for f in fmt_d], eps)
    else:
        n_len_s, n_len_d = group_normalize(len_s, eps=eps), group_normalize(len_d, eps=eps)
    n_fmt_s, n_fmt_d = group_normalize(fmt_s, eps=eps), group_normalize(fmt_d, eps=eps)
    n_acc = group_normalize(col(names.accuracy), eps=eps)
    n_eff = group_normalize(col(names.efficiency), eps=eps)
    return [
        HrpoAdvantage(
            adv_stream=w_fmt * n_fmt_s[i] + beta * n_len_s[i],
            adv_deep=w_fmt * n_fmt_d[i] + beta * n_len_d[i],
            adv_global=w_acc * n_acc[i] + beta * n_eff[i],
        )
        for i in range(len(components))
    ]


def assign(group: Group, rewards: Mapping[str, TrajectoryReward], p: HrpoParams) -> list[TokenAdvantages]:
    """A^s on the streaming tokens, A^d on the deep ones, A^g on every trained token."""
    trajs = group.trajectories
    h = hrpo(
        [reward_of(rewards, t).components for t in trajs],
        beta=p.beta,
        w_acc=p.w_acc,
        w_fmt=p.w_fmt,
        mask_length_by_format=p.mask_length_by_format,
        names=p.names,
        eps=p.eps,
    )
    out = []
    for t, hi in zip(trajs, h, strict=True):
        m = trained_mask(t)
        stream = [s & mm for s, mm in zip(kind_mask(t, "stream"), m, strict=True)]
        deep = [mm and not s for s, mm in zip(stream, m, strict=True)]
        out.append(
            TokenAdvantages(
                t,
                uniform(hi.adv_global, m),
                m,
                adv_stream=[hi.adv_stream if s else 0.0 for s in stream],
                adv_deep=[hi.adv_deep if d else 0.0 for d in deep],
                stream_mask=stream,
            )
        )
    return out


def loss(
    logp: Tensor,
    old: Tensor,
    adv: Tensor,
    mask: Tensor,
    rows: Sequence[TokenAdvantages],
    spec: LossSpec,
    terms: LossTerms,
) -> LossParts:
    """HRPO's three-term loss (AdaSR eq. 5, ``learner.losses.hrpo_loss``) over ``assign``'s rows:
    ``adv`` is A^g on every trained token; A^s, A^d and the streaming mask come from the rows."""
    width, dev = logp.shape[1], logp.device

    def padded(pick: str) -> Tensor:
        return pad_rows([getattr(s, pick) or [0] * len(s.mask) for s in rows], width, dev)

    return hrpo_loss(
        logp,
        old,
        padded("adv_stream"),
        padded("adv_deep"),
        adv,
        mask,
        padded("stream_mask"),
        lam=spec.hrpo_lambda,
        **terms,
    )
