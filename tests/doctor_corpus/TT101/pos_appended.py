from torch import nn
from torch.nn import Linear, Module


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.bn = nn.BatchNorm2d(c)

    def forward(self, x):
        return self.bn(self.conv(x)).relu()


class Tower(Block):
    def __init__(self, depth, c=32):
        super().__init__(c)
        self.blocks = []
        for _ in range(depth):
            self.blocks.append(Block(c))  # expect: TT101
        self.stages = [[Block(c) for _ in range(2)] for _ in range(3)]  # expect: TT101
        self.drops = (nn.Dropout(0.1), nn.Dropout(0.2))  # expect: TT101
        self.extra = {}
        self.extra["proj"] = nn.Linear(c, c)  # expect: TT101

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class Encoder(Module):
    def __init__(self):
        super().__init__()
        first = Linear(8, 8)
        second = Linear(8, 8)
        self.parts = [first, second]  # expect: TT101

    def forward(self, x):
        return self.parts[1](self.parts[0](x))
