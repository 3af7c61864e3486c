"""Models no one here wrote (Hugging Face transformers' classes, as the benchmark suite's
pyreducer/testing/third_party.py builds them, at test sizes): with the overlapped and the sharded
optimizer their parameters and buffers (BatchNorm's statistics, BERT's integer ids) end equal
to torch DDP's, bit for bit, on every rank."""
import copy

import pytest
import torch

pytest.importorskip("transformers")

STEPS = 4


def small_models():
    from transformers import (BertConfig, BertForSequenceClassification, ResNetConfig,
                              ResNetForImageClassification)

    resnet = ResNetForImageClassification(ResNetConfig(
        layer_type="basic", depths=[1, 1], hidden_sizes=[8, 16], embedding_size=8, num_labels=5))
    bert = BertForSequenceClassification(BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=12, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    return {"hf_resnet": (resnet, lambda g: (torch.randn(4, 3, 32, 32, generator=g),
                                               torch.randint(0, 5, (4,), generator=g))),
            "hf_bert": (bert, lambda g: (torch.randint(0, 64, (4, 12), generator=g),
                                         torch.randint(0, 3, (4,), generator=g)))}


def worker(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from pyreducer import DistributedDataParallel

    torch.manual_seed(0)
    out = {}
    for name, (base, batch) in small_models().items():
        for variant in ("torch", "overlap", "sharded"):
            module = copy.deepcopy(base)
            model = (TorchDDP if variant == "torch" else DistributedDataParallel)(
                module, bucket_cap_mb=0.01)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            if variant != "torch":
                opt = model.overlap_optimizer(opt, shard=variant == "sharded")
            gen = torch.Generator().manual_seed(rank)
            for _ in range(STEPS):
                x, y = batch(gen)
                torch.nn.functional.cross_entropy(model(x).logits, y).backward()
                opt.step()
                opt.zero_grad()
            if variant != "torch":
                model.synchronize()
            out[(name, variant)] = {k: v.detach().clone() for k, v in module.state_dict(
                keep_vars=True).items()} | {f"buffer {k}": v.clone() for k, v in module.named_buffers()}
    return out


@pytest.mark.parametrize("variant", ["overlap", "sharded"])
@pytest.mark.parametrize("name", ["hf_resnet", "hf_bert"])
def test_third_party_model_ends_as_torch_ddp(ranks_once, name, variant):
    for rank, r in enumerate(ranks_once(worker, 2, ())):
        theirs, ours = r[(name, "torch")], r[(name, variant)]
        assert ours.keys() == theirs.keys()
        for key, value in theirs.items():
            assert torch.equal(ours[key], value), f"rank {rank} {name} {variant}: {key}"
