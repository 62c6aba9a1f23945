"""Knowledge distillation (I6): train a small student on a big teacher's soft outputs.

A trained teacher's softened output distribution (softmax at temperature ``T`` > 1)
says which wrong classes are *nearly* right — information the one-hot labels lack — so
a student trained to match it usually beats the same student trained on labels alone
(Hinton, Vinyals & Dean, 2015). The soft term's gradients scale as ``1/T^2``; the loss
multiplies it by ``T^2`` so the balance ``alpha`` between soft and hard targets does not
change with the temperature.

Distillation plugs into :func:`torch_tricks.train.fit` with no change to the loop:
``fit(Distiller(student, teacher), train, val, loss_fn=DistillLoss(T, alpha))``. In
training mode the :class:`Distiller` returns ``(student_logits, teacher_logits)`` and
:class:`DistillLoss` computes :func:`kd_loss`; in eval mode it returns the student's
logits alone, so validation, accuracy, checkpoints and export see only the student.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from torch_tricks.errors import UserError
from torch_tricks.registry import register_trick

__all__ = ["kd_loss", "Distiller", "DistillLoss"]


def kd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    target: torch.Tensor,
    *,
    temperature: float = 4.0,
    alpha: float = 0.9,
) -> torch.Tensor:
    """Hinton's KD loss: ``alpha * T^2 * KL(softmax(t/T) || softmax(s/T)) + (1 - alpha) * CE(s, y)``.

    The KL term is averaged over the batch (``reduction="batchmean"``, the true KL per
    sample; ``"mean"`` would also divide by the number of classes). The teacher's logits
    are detached: no gradient flows into the teacher.
    """
    _check_kd_args(temperature, alpha)
    if student_logits.shape != teacher_logits.shape:
        raise UserError(
            f"kd_loss: student logits {tuple(student_logits.shape)} and teacher logits "
            f"{tuple(teacher_logits.shape)} differ: the two models must predict the same classes"
        )
    t = float(temperature)
    s = student_logits.float()
    soft_teacher = F.log_softmax(teacher_logits.detach().float() / t, dim=-1)
    soft = F.kl_div(F.log_softmax(s / t, dim=-1), soft_teacher, reduction="batchmean", log_target=True)
    loss = alpha * t * t * soft
    if alpha < 1.0:
        loss = loss + (1.0 - alpha) * F.cross_entropy(s, target)
    return loss


class DistillLoss(nn.Module):
    """``loss_fn`` for :func:`torch_tricks.train.fit`: :func:`kd_loss` on the
    ``(student_logits, teacher_logits)`` pair a training-mode :class:`Distiller` returns,
    plain cross-entropy on plain logits (validation, or a model without a teacher)."""

    def __init__(self, temperature: float = 4.0, alpha: float = 0.9) -> None:
        super().__init__()
        _check_kd_args(temperature, alpha)
        self.temperature, self.alpha = float(temperature), float(alpha)

    def forward(self, outputs: Any, target: torch.Tensor) -> torch.Tensor:
        if isinstance(outputs, (tuple, list)) and len(outputs) == 2:
            student, teacher = outputs
            return kd_loss(student, teacher, target, temperature=self.temperature, alpha=self.alpha)
        return F.cross_entropy(outputs, target)

    def extra_repr(self) -> str:
        return f"temperature={self.temperature}, alpha={self.alpha}"


class Distiller(nn.Module):
    """The student, with a frozen teacher riding along in training mode.

    Only the student is a registered submodule, so ``parameters()`` (and hence the
    optimizer) never see the teacher; ``state_dict()``/``load_state_dict()`` are the
    student's own, without a ``student.`` prefix, so a checkpoint saved while distilling
    loads into the bare student. The teacher is kept in eval mode (its BN/dropout frozen), its parameters
    have ``requires_grad=False``, and it runs under ``no_grad``. ``.to()`` / ``.cuda()``
    / ``.half()`` move the teacher along with the student.
    """

    def __init__(self, student: nn.Module, teacher: nn.Module) -> None:
        super().__init__()
        if not isinstance(student, nn.Module) or not isinstance(teacher, nn.Module):
            raise UserError("Distiller(student, teacher) needs two nn.Modules")
        if student is teacher:
            raise UserError("Distiller: the student and the teacher are the same module: pass a separate teacher")
        self.student = student
        teacher.eval()
        for p in teacher.parameters():
            p.requires_grad_(False)
        object.__setattr__(self, "teacher", teacher)  # not registered: not in parameters() / state_dict()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self.student(*args, **kwargs)
        if not self.training:
            return out
        with torch.no_grad():
            t_out = self.teacher(*args, **kwargs)
        return out, t_out

    def train(self, mode: bool = True) -> "Distiller":
        super().train(mode)
        self.teacher.eval()  # the teacher's BN statistics and dropout stay frozen
        return self

    def _apply(self, fn: Any, recurse: bool = True) -> "Distiller":
        super()._apply(fn, recurse)
        self.teacher._apply(fn)
        return self

    # The state dict is the student's, without a "student." prefix, so checkpoints saved
    # while distilling load into the plain student model.
    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.student.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return self.student.load_state_dict(state_dict, strict=strict, assign=assign)


def _check_kd_args(temperature: float, alpha: float) -> None:
    if not temperature > 0:
        raise UserError(f"distillation temperature must be > 0, not {temperature}")
    if not 0.0 <= alpha <= 1.0:
        raise UserError(f"distillation alpha weights the soft loss and must be in [0, 1], not {alpha}")


@register_trick(
    "distillation",
    ids=("I6",),
    kind="train",
    trades="a teacher forward per training step (slower steps) for a small student that is more accurate than one trained on labels alone",
    needs="a trained teacher with the same output classes as the student",
)
def distill(student: nn.Module, teacher: nn.Module) -> Distiller:
    """Wrap ``student`` and ``teacher`` for ``fit(..., loss_fn=DistillLoss(T, alpha))``."""
    return Distiller(student, teacher)
