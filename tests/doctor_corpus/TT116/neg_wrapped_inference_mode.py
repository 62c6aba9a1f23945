"""A project's own decorator or context manager that turns autograd off (YOLOv5's smart_inference_mode)."""
from utils.torch_utils import smart_inference_mode, maybe_no_grad


@smart_inference_mode()
def run(model, dataloader):
    model.eval()
    for im, targets in dataloader:
        preds = model(im)
    return preds


def evaluate(model, loader):
    model.eval()
    with maybe_no_grad():
        return [model(x) for x, _ in loader]
