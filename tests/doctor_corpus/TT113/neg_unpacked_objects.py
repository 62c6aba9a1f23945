"""Objects handed in whose .to() may move in place (a BatchEncoding, a PyG Batch): no tensor use shows."""


def hf_step(model, batch, device):
    inputs, labels = batch
    inputs.to(device)  # a BatchEncoding moves its tensors in place and returns itself
    return model(**inputs, labels=labels)


def graph_step(model, data, device):
    data.to(device)
    out = model(data.x, data.edge_index)
    return out


def rebinds(batch, device, transform):
    x, y = batch
    x.cuda()  # discarded, but nothing shows this x is a tensor
    x = transform(x)
    return x.view(-1), y  # the view is of another binding of x: not evidence for the first
