"""The loss names ``--loss`` and :func:`torch_tricks.outputs.get_loss` take, apart from torch.

The command line's parser is built for every command, a static ``doctor`` lint included,
which reads code and must not pay for importing torch.
"""

LOSSES = ("auto", "ce", "nll", "mse", "bce-with-logits", "none")
