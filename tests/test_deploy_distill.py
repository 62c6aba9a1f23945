"""I6: the KD loss is Hinton's, and fit() distills through the Distiller wrapper unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from torch_tricks.deploy.distill import Distiller, DistillLoss, kd_loss
from torch_tricks.errors import UserError
from torch_tricks.models import get_model
from torch_tricks.registry import get_trick


@pytest.fixture
def one_thread():
    # Tiny models on shared cores: a second intra-op thread only spins (5x slower under load).
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


def test_kd_loss_matches_hand_computation():
    s = torch.tensor([[2.0, 0.5, -1.0], [0.1, 0.2, 0.3]])
    t = torch.tensor([[1.5, 1.0, -0.5], [2.0, -1.0, 0.0]])
    y = torch.tensor([0, 2])
    T, alpha = 3.0, 0.7
    p_t = torch.softmax(t / T, dim=1)
    log_p_s = torch.log_softmax(s / T, dim=1)
    kl = (p_t * (torch.log(p_t) - log_p_s)).sum(dim=1).mean()  # KL(p_t || p_s), per sample, averaged
    ce = -torch.log_softmax(s, dim=1)[torch.arange(2), y].mean()
    expected = alpha * T * T * kl + (1 - alpha) * ce
    torch.testing.assert_close(kd_loss(s, t, y, temperature=T, alpha=alpha), expected)
    torch.testing.assert_close(kd_loss(s, t, y, alpha=0.0), F.cross_entropy(s, y))
    assert kd_loss(t, t, y, alpha=1.0).abs() < 1e-6  # identical distributions: no soft loss


def test_kd_loss_gradient_stops_at_teacher_and_rejects_bad_args():
    s = torch.randn(4, 5, requires_grad=True)
    t = torch.randn(4, 5, requires_grad=True)
    kd_loss(s, t, torch.tensor([0, 1, 2, 3])).backward()
    assert s.grad is not None and t.grad is None
    with pytest.raises(UserError, match="temperature"):
        kd_loss(s, t, torch.zeros(4, dtype=torch.long), temperature=0)
    with pytest.raises(UserError, match="alpha"):
        DistillLoss(alpha=1.5)
    with pytest.raises(UserError, match="same classes"):
        kd_loss(s, torch.randn(4, 6), torch.zeros(4, dtype=torch.long))


def test_distiller_exposes_only_the_student():
    student, teacher = get_model("small_cnn", widths=(8, 16, 16)), get_model("small_cnn")
    d = Distiller(student, teacher)
    assert {id(p) for p in d.parameters()} == {id(p) for p in student.parameters()}
    assert list(d.state_dict()) == list(student.state_dict())
    assert all(not p.requires_grad for p in teacher.parameters())
    d.train()
    assert d.training and student.training and not teacher.training
    x = torch.randn(4, 1, 8, 8)
    out = d(x)
    assert isinstance(out, tuple) and len(out) == 2
    DistillLoss()(out, torch.tensor([0, 1, 2, 3])).backward()
    assert all(p.grad is None for p in teacher.parameters())
    d.eval()
    assert isinstance(d(x), torch.Tensor)
    fresh = get_model("small_cnn", widths=(8, 16, 16))
    fresh.load_state_dict(d.state_dict())  # a distillation checkpoint loads into the bare student
    with pytest.raises(UserError, match="same module"):
        Distiller(student, student)


def test_distilled_student_learns_digits(one_thread):
    pytest.importorskip("sklearn")
    from torch_tricks.data.digits import load_dataset
    from torch_tricks.train.config import TrainConfig
    from torch_tricks.train.loop import fit

    train, val = load_dataset("digits")
    cfg = TrainConfig(epochs=4, batch_size=64, lr=3e-3, progress=False, device="cpu")
    teacher = get_model("small_cnn")
    assert fit(teacher, train, val, config=cfg).final["acc"] >= 0.95
    teacher_state = {k: v.clone() for k, v in teacher.state_dict().items()}

    student = get_model("small_cnn", widths=(16, 32, 32))
    # the soft targets need a few more steps than labels do: lr 1e-2, cosine, 5 epochs
    student_cfg = cfg.replace(lr=1e-2, epochs=5, schedule="cosine")
    hist = fit(Distiller(student, teacher), train, val, loss_fn=DistillLoss(temperature=4.0, alpha=0.9), config=student_cfg)
    assert hist.final["acc"] >= 0.95, hist.final
    assert all(torch.equal(v, teacher_state[k]) for k, v in teacher.state_dict().items())  # teacher untouched
    assert all(p.grad is None for p in teacher.parameters())
    assert not teacher.training


def test_distillation_trick_registered():
    trick = get_trick("distillation")
    assert trick.ids == ("I6",) and trick.kind == "train"
    assert isinstance(trick.fn(nn.Linear(2, 2), nn.Linear(2, 2)), Distiller)
