"""TT109 ``size_average=`` / ``reduce=`` given as ``True``/``False``/``None``: replaced with the
``reduction=`` torch's own legacy rule gives (``reduce=False`` -> ``"none"``,
``size_average=False`` -> ``"sum"``, otherwise ``"mean"``), for the losses whose signature is
known, without ``reduction=`` also given and without positional arguments reaching those
parameters.
"""

from __future__ import annotations

import ast

from torch_tricks.doctor import Finding
from torch_tricks.doctor.analysis import dotted
from torch_tricks.doctor.fix.base import _Fix, _NotFixable
from torch_tricks.doctor.fix.doc import _call_at, _Doc
from torch_tricks.doctor.fix.edits import _deletion, _kw, _starred


# the number of parameters before size_average (reduce follows it) in each loss taking them
_LEGACY_SLOT = {
    **dict.fromkeys("l1_loss mse_loss smooth_l1_loss kl_div multilabel_margin_loss soft_margin_loss".split(), 2),
    **dict.fromkeys("binary_cross_entropy binary_cross_entropy_with_logits cross_entropy nll_loss "
                    "hinge_embedding_loss multilabel_soft_margin_loss".split(), 3),
    **dict.fromkeys("poisson_nll_loss cosine_embedding_loss margin_ranking_loss".split(), 4),
    "multi_margin_loss": 5, "triplet_margin_loss": 7,
    **dict.fromkeys("L1Loss MSELoss SmoothL1Loss KLDivLoss MultiLabelMarginLoss SoftMarginLoss".split(), 0),
    **dict.fromkeys("NLLLoss NLLLoss2d CrossEntropyLoss BCELoss BCEWithLogitsLoss MultiLabelSoftMarginLoss "
                    "HingeEmbeddingLoss CosineEmbeddingLoss MarginRankingLoss".split(), 1),
    "PoissonNLLLoss": 2, "MultiMarginLoss": 3, "TripletMarginLoss": 4,
}


def _fix_legacy_reduction(doc: _Doc, f: Finding) -> _Fix:
    call = _call_at(doc, f)
    name = dotted(call.func).rsplit(".", 1)[-1]
    if name not in _LEGACY_SLOT:
        raise _NotFixable(f"the signature of {name} is not known here")
    legacy = _legacy_keywords(call, _LEGACY_SLOT[name])
    values = _legacy_values(legacy)
    reduction = _legacy_reduction(values.get("size_average"), values.get("reduce"))
    first, rest = legacy[0], legacy[1:]
    edits = [(doc.start(first), doc.end(first), f'reduction="{reduction}"')]
    edits += [_deletion(doc, call, k) for k in rest]

    def mutate(m: dict) -> None:
        c = m[id(call)]
        drop = {id(m[id(k)]) for k in rest}
        c.keywords = [ast.keyword(arg="reduction", value=ast.Constant(reduction)) if k is m[id(first)] else k
                      for k in c.keywords if id(k) not in drop]
    old = ", ".join(doc.text(k) for k in legacy)
    return _Fix(("TT109",), f.line, f'{name}(...): {old} -> reduction="{reduction}"', edits, mutate)


def _legacy_keywords(call: ast.Call, slot: int) -> list[ast.keyword]:
    """The ``size_average=`` / ``reduce=`` of ``call`` (``slot`` parameters come before them); not
    fixable when ``reduction=`` or arguments that may reach them are passed too."""
    legacy = [k for k in call.keywords if k.arg in ("size_average", "reduce")]
    if not legacy or _starred(call) or _kw(call, "reduction") or len(call.args) > slot:
        raise _NotFixable("reduction= or more arguments are passed too")
    return legacy


def _legacy_values(legacy: list[ast.keyword]) -> dict[str, bool | None]:
    """``size_average`` / ``reduce`` -> the constant given; not fixable when one is not a constant."""
    values = {}
    for k in legacy:
        if not (isinstance(k.value, ast.Constant) and (k.value.value is None or isinstance(k.value.value, bool))):
            raise _NotFixable(f"{k.arg}= is not a True/False/None constant")
        values[k.arg] = k.value.value
    return values


def _legacy_reduction(size_average: bool | None, reduce: bool | None) -> str:
    """torch.nn._reduction.legacy_get_string."""
    size_average = True if size_average is None else size_average
    reduce = True if reduce is None else reduce
    return "mean" if size_average and reduce else "sum" if reduce else "none"
