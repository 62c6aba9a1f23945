"""eval() on layers without parameters (unit tests of dropout-like layers): autograd records nothing."""
import torch
from timm.layers import DropBlock2d, DropPath
from torch import nn


def test_dropout_eval_is_identity():
    module = nn.Dropout(0.5)
    x = torch.ones(2, 3)
    module.eval()
    result = module(x)
    assert torch.equal(result, x)


def test_drop_path_eval():
    drop = DropPath(0.1)
    block = DropBlock2d(0.1, 3)
    x = torch.ones(2, 3, 8, 8)
    drop.eval()
    block.eval()
    assert torch.equal(drop(x), x) and torch.equal(block(x), x)
