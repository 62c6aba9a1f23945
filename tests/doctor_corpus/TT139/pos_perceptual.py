import torch
import torch.nn as nn
import torch.nn.functional as F
from torchvision import models
from torchvision.models import vgg19


class VGGPerceptualLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = models.vgg16(weights=models.VGG16_Weights.DEFAULT).features[:16].eval()  # expect: TT139

    def forward(self, x, y):
        return F.mse_loss(self.features(x), self.features(y))


class FeatureExtractor(nn.Module):
    """As in SRGAN: VGG19 up to a layer, the content loss compares its features."""

    def __init__(self):
        super().__init__()
        vgg19_model = vgg19(pretrained=True)
        self.vgg19_54 = nn.Sequential(*list(vgg19_model.features.children())[:35])

    def forward(self, img):
        return self.vgg19_54(img)


generator = Generator()
feature_extractor = FeatureExtractor()
feature_extractor.eval()
if cuda:
    feature_extractor = feature_extractor.cuda()
criterion_content = nn.L1Loss()
optimizer_G = torch.optim.Adam(generator.parameters(), lr=2e-4)
for imgs_lr, imgs_hr in loader:
    optimizer_G.zero_grad()
    gen_hr = generator(imgs_lr)
    gen_features = feature_extractor(gen_hr)
    real_features = feature_extractor(imgs_hr)
    loss_content = criterion_content(gen_features, real_features.detach())  # expect: TT139
    loss_content.backward()
    optimizer_G.step()
