import torch.nn as nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(8, 16, batch_first=True)
        self.gru = nn.GRU(16, 16)

    def forward(self, x, lengths):
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, (h, c) = self.lstm(packed)
        values = out.data  # PackedSequence.data: the packed time steps, not Tensor.data
        out2, _ = self.gru(out)
        steps = out2.data
        padded, _ = pad_packed_sequence(out, batch_first=True)
        return padded, values, steps


def batch_sizes(seq):
    packed = pack_padded_sequence(seq, [3, 2], enforce_sorted=False)
    return packed.data.shape, packed.batch_sizes
