import torch


def teacher_logits(teacher, x):
    """A frozen model records no graph: no_grad would change nothing."""
    teacher.requires_grad_(False)
    teacher.eval()
    return teacher(x)


def features(backbone, images):
    for p in backbone.parameters():
        p.requires_grad = False
    backbone.eval()
    return backbone(images)


def embed(encoder, batch):
    encoder.eval().requires_grad_(False)
    return encoder(batch)
