from torch_geometric.loader import DataLoader as GeoLoader


def pyg_train(model, dataset, device):
    loader = GeoLoader(dataset, batch_size=32)
    for batch in loader:
        batch.to(device)  # PyG's Batch.to() moves in place and returns self
        model(batch)


def hf_train(model, loader, device):
    for batch in loader:
        batch.to(device)  # a custom-collated batch object (e.g. BatchEncoding) may move in place
        model(**batch)
