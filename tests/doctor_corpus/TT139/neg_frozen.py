import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision


class PerceptualLoss(nn.Module):
    """Frozen where built."""

    def __init__(self):
        super().__init__()
        vgg = torchvision.models.vgg19(weights="DEFAULT").features[:16]
        for p in vgg.parameters():
            p.requires_grad = False
        self.vgg = vgg

    def forward(self, x, y):
        return F.l1_loss(self.vgg(x), self.vgg(y))


class StyleLoss(nn.Module):
    """Built without pretrained weights (a random-feature loss, as some papers use): not this rule."""

    def __init__(self):
        super().__init__()
        self.net = torchvision.models.vgg11(weights=None).features

    def forward(self, x, y):
        return F.mse_loss(self.net(x), self.net(y))


class ContentLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.vgg = torchvision.models.vgg16(pretrained=True).features


content = ContentLoss()
content.requires_grad_(False)  # frozen by its user

siamese = Encoder()
opt = torch.optim.Adam(siamese.parameters(), lr=1e-3)  # the shared network is the one trained
extractor = torchvision.models.resnet18(weights="DEFAULT")
extractor.requires_grad_(False)
extractor.eval()
teacher = Teacher()
student = Student(teacher)  # handed to another model: it may train it
for a, b in loader:
    loss = F.mse_loss(siamese(a), siamese(b))
    loss = loss + F.mse_loss(extractor(a), extractor(b).detach())
    loss = loss + F.mse_loss(teacher(a), teacher(b))
    with torch.no_grad():
        target = siamese(b)
    opt.zero_grad()
    loss.backward()
    opt.step()
