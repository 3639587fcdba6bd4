"""The torch layer: paged KV tensors, attention over block tables, models, weights, sampling."""
