"""The runtime doctor's rules (``TT2xx``): their ids, names, messages and explanations.

Declared apart from :mod:`torch_tricks.doctor.runtime`, which runs a model to find them,
so that ``doctor --list``, ``--explain`` and the rule codes of ``--select``/``--ignore``
work without importing torch (a static lint never needs it).
"""

from __future__ import annotations

from torch_tricks.doctor.registry import Rule, register_rule

__all__ = ["MIN_BN_BATCH", "RULES", "UNUSED_PARAMS", "DECAY_ON_NO_DECAY", "UNREGISTERED", "BN_SMALL_BATCH", "INPLACE",
           "DIMS", "LOSS_PAIRING", "MODE_MISMATCH", "RANDOM_IN_EVAL", "NON_FINITE", "MEMORY_GROWTH", "COUPLED_L2",
           "NOT_OPTIMIZED", "TARGET_BROADCAST"]

#: Per-device batch below which BatchNorm statistics are too noisy (seeds/001).
MIN_BN_BATCH = 8


def _rule(id: str, name: str, severity: str, message: str, explanation: str, source: str) -> Rule:
    return register_rule(Rule(id, name, message, explanation, severity, source, kind="runtime"))


UNUSED_PARAMS = _rule(
    "TT201", "unused-parameters", "warning",
    "parameters get no gradient in a training step",
    "A layer that is built but never used in forward, or whose output never reaches the "
    "loss, gets no gradient: it costs memory and is never trained. If the optimizer holds "
    "it with weight decay, it is shrunk towards zero whenever its .grad is a zero tensor "
    "rather than None (zero_grad(set_to_none=False), or after it was used once): the "
    "hidden bug of a ResNet whose unused layer4 decayed to zero. Fix: delete the layer, or "
    "set requires_grad=False and keep it out of the optimizer until it is used. Judged on "
    "one step: a branch used only for some inputs shows up too.",
    "T6, T15; seeds/003 Pytorch 使用陷阱 4 (weight_decay shrinks an unused layer4)",
)
DECAY_ON_NO_DECAY = _rule(
    "TT202", "weight-decay-on-bias-or-norm", "warning",
    "weight decay applies to bias / normalisation parameters",
    "Weight decay pulls a weight towards zero. A bias shifts and a norm scale rescales a "
    "feature; decaying them removes capacity instead of regularising (PyTorch's optimizers "
    "decay every parameter they are given). Fix: build the optimizer on "
    "torch_tricks.train.optim.param_groups(model, weight_decay), which puts biases, norm "
    "parameters and other 0-/1-D parameters in a group with weight_decay=0.",
    "T15; seeds/003 Pytorch 使用陷阱 6 (weight decay also hits the bias by default)",
)
UNREGISTERED = _rule(
    "TT203", "unregistered-module", "error",
    "modules stored in a plain list/dict attribute are not registered",
    "nn.Module registers a submodule only when it is assigned as an attribute directly or "
    "held by nn.ModuleList / nn.ModuleDict / nn.Sequential. Modules in a plain Python list, "
    "tuple or dict run in forward, but their parameters are missing from "
    "model.parameters() (the optimizer never trains them), from state_dict() (checkpoints "
    "lose them), from .to(device) and from train()/eval(). Nothing raises. Fix: wrap the "
    "container in nn.ModuleList / nn.ModuleDict (nested lists too), parameters in "
    "nn.ParameterList / nn.ParameterDict.",
    "X; seeds/003 网络模型构建 1 (nn.ModuleList, not a plain list) and Tensor的操作 10 (注册参数)",
)
BN_SMALL_BATCH = _rule(
    "TT204", "batchnorm-small-batch", "warning",
    f"BatchNorm trains on a per-device batch below {MIN_BN_BATCH}",
    f"BatchNorm normalises with the mean and variance of the batch on each device. With "
    f"fewer than {MIN_BN_BATCH} samples these statistics are noisy, training becomes "
    "unstable and the running statistics used at evaluation do not match. Gradient "
    "accumulation does not help: BN still sees the small batch. Fix: a larger per-device "
    "batch; SyncBatchNorm across devices (torch_tricks.train.syncbn); or GroupNorm / "
    "LayerNorm, which do not depend on the batch.",
    "X, T11, T19; seeds/001 基本操作 check list (batch_norm with a per-GPU batch < 8); "
    "seeds/003 Pytorch训练阶段 2 (gradient accumulation does not enlarge BN's batch)",
)
INPLACE = _rule(
    "TT205", "activation-could-be-inplace", "info",
    "an activation could run inplace",
    "An activation whose input is a fresh tensor that nothing else reads (a conv, linear or "
    "norm output) can overwrite it: ReLU(inplace=True) saves one activation-sized buffer "
    "per call, and LeakyReLU/ELU/SELU also a saved tensor. Only activations judged safe "
    "on a torch.fx trace are reported (not those on a residual branch or on the model's "
    "input). Fix: inplace=True, or torch_tricks.train.memory.inplace_activations(model). "
    "The saving is small for ReLU; measure it before caring.",
    "T9; seeds/001 基本操作 check list (relu 用 inplace=True); seeds/003 Pytorch的内存优化和加速 1",
)
DIMS = _rule(
    "TT206", "dim-not-multiple-of-8", "info",
    "layer dimensions are not multiples of 8",
    "Tensor cores multiply fp16/bf16 matrices in tiles of 8: a Linear's in/out features, "
    "a conv's channels per group and an RNN's input/hidden sizes that are multiples of 8 "
    "run on them, others are padded or fall back to slower kernels. Fix: round hidden "
    "sizes up to a multiple of 8 (64 is better still). Dimensions fixed by the data (the "
    "input channels, the number of classes of the output layer) are not reported.",
    "T23; seeds/003 Pytorch的内存优化和加速 8 (如何才能使用 Tensor Core)",
)
LOSS_PAIRING = _rule(
    "TT207", "output-loss-mismatch", "error",
    "the output fed to the loss does not match what the loss expects",
    "Each loss expects one kind of input. CrossEntropyLoss and BCEWithLogitsLoss want raw "
    "logits (they apply log_softmax / sigmoid themselves); NLLLoss wants log-probabilities "
    "(log_softmax); BCELoss wants probabilities in [0, 1]. Probabilities fed to "
    "CrossEntropyLoss or BCEWithLogitsLoss are squashed twice, so the loss and its "
    "gradients shrink and training stalls; logits fed to NLLLoss are not a likelihood at "
    "all. log_softmax before CrossEntropyLoss is redundant (log_softmax is idempotent: same "
    "loss, wasted work, and the model's output is not logits). Judged on the actual "
    "tensors: rows that sum to 1 in [0, 1] are probabilities, rows with logsumexp 0 and no "
    "positive value are log-probabilities. Fix: return logits and use CrossEntropyLoss / "
    "BCEWithLogitsLoss (the numerically stable pairs).",
    "X; seeds/004 模型设计 激活函数和损失函数 (输出层激活函数与损失函数需要配套)",
)
MODE_MISMATCH = _rule(
    "TT208", "train-eval-mode-mismatch", "warning",
    "part of the model is in a different train/eval mode than the rest",
    "model.train() / model.eval() set every submodule; calling .eval() or .train() on a "
    "submodule afterwards (or keeping it outside the registered modules) leaves it in the "
    "other mode. In a training model, an eval-mode Dropout does nothing and an eval-mode "
    "BatchNorm normalises with stale running statistics; in an evaluating model, a "
    "train-mode Dropout still drops and a train-mode BatchNorm uses batch statistics and "
    "overwrites its running ones. Fix: call model.train() / model.eval() last. A frozen "
    "part (all its parameters requires_grad=False) kept in eval on purpose is not reported.",
    "T13; seeds/003 Pytorch 测试阶段 2 (训练,测试两个阶段需要注意设置不同状态: BN 和 Dropout)",
)
RANDOM_IN_EVAL = _rule(
    "TT209", "random-output-in-eval", "warning",
    "the model in eval mode gives different outputs for the same input",
    "In eval mode a model should be a deterministic function. Different outputs for the "
    "same batch mean something random ignores eval(): most often F.dropout(x, p) without "
    "training=self.training (its default is training=True), or a custom sampling op. "
    "Fix: pass training=self.training, or use the nn.Dropout module.",
    "X (F.dropout without training=); seeds/003 Pytorch 测试阶段 3 (Dropout里需要设置训练标志位)",
)
NON_FINITE = _rule(
    "TT210", "non-finite-values", "error",
    "NaN or Inf appears in a training step",
    "The first place a NaN/Inf appears is the bug; everything after it is a consequence. "
    "The module named is the innermost one that turned finite values into non-finite ones. "
    "Forward causes: log or division of 0, overflow in fp16, exp of large values. Backward "
    "from a finite forward: sqrt / pow(x, 0.5) at exactly 0, acos/asin at +-1. Fix: clamp "
    "or add an eps before log / division / sqrt (torch.linalg.norm has a safe gradient at "
    "0), keep overflow-prone ops in fp32; torch.autograd.detect_anomaly() then points at "
    "the exact op.",
    "T25, X (sqrt of a sum of squares); seeds/003 Pytorch 使用陷阱 7 (torch.sqrt 在0处 nan) "
    "and 8 (detect_anomaly)",
)
MEMORY_GROWTH = _rule(
    "TT211", "memory-growth", "warning",
    "memory grows from one training step to the next",
    "Live tensor memory or the autograd graphs kept alive grow with every step: something "
    "keeps a reference to each step's tensors. Typical: a module or loss appending "
    "outputs / losses to a list, a cache that is never cleared, `total_loss += loss` "
    "(keeps every step's graph). It ends in an out-of-memory error hours into training. "
    "Fix: store loss.item() or tensor.detach() (and .cpu() if kept long), bound or clear "
    "caches, del intermediates that are no longer needed.",
    "T27, T4; seeds/003 Pytorch 使用陷阱 2 (损失计算图越来越大, list 不断 append)",
)
COUPLED_L2 = _rule(
    "TT212", "adam-l2-not-weight-decay", "warning",
    "Adam's weight_decay is L2 regularisation, not weight decay",
    "Adam (and NAdam/RAdam without decoupled_weight_decay) adds weight_decay * w to the "
    "gradient, and Adam then divides the gradient by its running scale: weights with large "
    "gradients are barely decayed. That is L2 regularisation, which Loshchilov & Hutter "
    "showed is not equivalent to weight decay for adaptive optimizers. Fix: AdamW (values "
    "of 1e-2..1e-1 are typical where Adam+L2 used 1e-4), or "
    "torch_tricks.train.optim.build_optimizer('adam', weight_decay=...) which builds AdamW.",
    "T15; seeds/003 Pytorch 使用陷阱 5 (L2正则不等于权值衰减)",
)
NOT_OPTIMIZED = _rule(
    "TT213", "trainable-not-in-optimizer", "warning",
    "trainable parameters are missing from the optimizer",
    "Parameters with requires_grad=True that the optimizer does not hold get a gradient "
    "every step (backward compute and gradient memory) but never change. Either a layer "
    "was added after the optimizer was built (a bug: it never trains), or it is meant to "
    "be frozen. Fix: build the optimizer after the model is complete (or add_param_group), "
    "or freeze with requires_grad=False, which also skips its backward.",
    "T14; seeds/003 Pytorch 使用陷阱 4 (暂时不需要更新的权值,一定不要传递给Optimizer)",
)

TARGET_BROADCAST = _rule(
    "TT214", "target-broadcast", "error",
    "the loss's target has a different shape from the prediction and broadcasts against it",
    "Elementwise losses (MSELoss, L1Loss, SmoothL1Loss, HuberLoss, BCELoss ...) compare prediction "
    "and target element by element after broadcasting them to one shape. A prediction of shape "
    "(N, 1) against a target of shape (N,) broadcasts to (N, N): every prediction is compared with "
    "every target, the loss is a number but a meaningless one, and the model learns to predict the "
    "mean. torch only warns ('Using a target size ... that is different to the input size'). Fix: "
    "make the shapes equal: output.squeeze(-1) or target.unsqueeze(-1) (or target.view_as(output)).",
    "X; seeds/003 Tensor的操作 7 (损失函数: 输入和target的大小都是NxCxWxH, the loss is taken element by "
    "element); seeds/004 模型设计 激活函数和损失函数 (输出层与损失函数需要配套)",
)

PARAMS_TWICE = _rule(
    "TT215", "parameters-in-optimizer-twice", "error",
    "the same parameters are in the optimizer more than once: each step updates them twice",
    "A module shared by two sub-models (an encoder in both the generator and the reconstructor) is passed "
    "twice when both sub-models' parameters() go to one optimizer: the group then holds the same tensor twice, "
    "and every step applies its update twice (twice the learning rate for those weights, and Adam's moments "
    "updated twice). torch only warns ('optimizer contains a parameter group with duplicate parameters'). "
    "Fix: deduplicate, e.g. list({id(p): p for p in params}.values()), or build the optimizer over the module "
    "that holds both.",
    "X (the optimizer's parameters); T14; seeds/003 Pytorch 使用陷阱 4 (what goes to the Optimizer: "
    "暂时不需要更新的权值,一定不要传递给Optimizer)",
)

FROZEN_IN_TRAIN = _rule(
    "TT216", "frozen-module-in-train-mode", "warning",
    "a frozen submodule (no parameter requires grad) is in train mode: its BatchNorm statistics keep changing",
    "Freezing a backbone (requires_grad=False) stops its weights, not its BatchNorm running statistics: in "
    "train mode each forward normalises with the batch's statistics and moves the running ones toward the new "
    "data, so the 'frozen' features drift away from those it was trained with (and a perceptual-loss "
    "network's features change while it is used as a fixed metric). Fix: call .eval() on the frozen part "
    "after every model.train() (or override train() to keep it in eval). Dropout in a frozen part is not "
    "reported: keeping it on while adapters train (LoRA) is a choice.",
    "X (frozen modules); T10; seeds/001 基本操作 check list (用 eval() 和 with torch.no_grad(): a module's "
    "mode is set by eval(), not by freezing)",
)

#: Every runtime rule, by id.
RULES: tuple[Rule, ...] = (
    UNUSED_PARAMS, DECAY_ON_NO_DECAY, UNREGISTERED, BN_SMALL_BATCH, INPLACE, DIMS, LOSS_PAIRING,
    MODE_MISMATCH, RANDOM_IN_EVAL, NON_FINITE, MEMORY_GROWTH, COUPLED_L2, NOT_OPTIMIZED, TARGET_BROADCAST,
    PARAMS_TWICE, FROZEN_IN_TRAIN,
)
