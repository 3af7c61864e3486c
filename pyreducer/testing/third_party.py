"""Models no one here wrote, for the benchmark suite (benchmarks/bench_suite.py): built from their
packages' own classes and configs, randomly initialised, with no download.

Each entry is a `models.Spec` (build, batch generator, loss) and registers under its name in
`models.SPECS` when this module is imported (models.spec imports it for a name it does not know):

    hf_resnet18  Hugging Face `ResNetForImageClassification`, the ResNet-18 shape (basic blocks,
                 depths 2-2-2-2, widths 64-512): 11.2 M parameters in 62 tensors, 60 BatchNorm
                 buffers (20 BatchNorms: running mean, variance, batches tracked); 112 x 112 images
    hf_bert      Hugging Face `BertForSequenceClassification`, 4 layers of width 256: 11.2 M
                 parameters, of which 7.8 M in the word embeddings (read at a few rows only: their
                 gradient is dense, mostly zeros); 2 integer buffers (position and token-type ids)
    hf_gpt2      Hugging Face `GPT2LMHeadModel`, 4 layers of width 256, the output layer tied to the
                 token embedding (12.9 M of its 16.1 M parameters); no buffers
    tv_resnet18  torchvision's `resnet18(num_classes=100)` where torchvision is installed

transformers is a test dependency (pyproject's `test` extra); torchvision is not: the suite says
when it cannot be imported (unavailable) and runs the others.
"""
from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F

from pyreducer.testing import models

IMAGE_CLASSES = 100
SEQUENCE = 128  # tokens per sample (BERT, GPT-2)
BERT_LABELS = 4
GPT2_VOCAB = 50257  # GPT-2's tokenizer
BERT_VOCAB = 30522  # BERT's uncased tokenizer


def hf_resnet18():
    from transformers import ResNetConfig, ResNetForImageClassification

    return ResNetForImageClassification(ResNetConfig(
        layer_type="basic", depths=[2, 2, 2, 2], hidden_sizes=[64, 128, 256, 512],
        embedding_size=64, num_labels=IMAGE_CLASSES))


def hf_bert():
    from transformers import BertConfig, BertForSequenceClassification

    return BertForSequenceClassification(BertConfig(
        vocab_size=BERT_VOCAB, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
        intermediate_size=1024, max_position_embeddings=SEQUENCE, num_labels=BERT_LABELS,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def hf_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(
        vocab_size=GPT2_VOCAB, n_positions=SEQUENCE, n_embd=256, n_layer=4, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def tv_resnet18():
    import torchvision

    return torchvision.models.resnet18(weights=None, num_classes=IMAGE_CLASSES)


PACKAGES = {"hf_resnet18": "transformers", "hf_bert": "transformers", "hf_gpt2": "transformers",
            "tv_resnet18": "torchvision"}


def unavailable(name: str) -> str | None:
    """Why model `name` cannot be built here (its package missing, or built for another torch:
    PyPI's torchvision wheels link CUDA torch's libraries, and torch's CPU wheels come from
    download.pytorch.org only), or None."""
    package = PACKAGES.get(name)
    if package is None:
        return None
    try:
        importlib.import_module(package)
    except Exception as e:  # ImportError, or the RuntimeError of a mismatched build
        return f"{name} needs {package}, which cannot be imported here ({type(e).__name__}: {e})"
    return None


# Dropout is off in the language models: each rank draws the same masks as torch DDP's run only
# if their generators advance alike, which the parity check needs and the timing does not.


def _images112(gen, size):
    return (torch.randn(size, 3, 112, 112, generator=gen),
            torch.randint(0, IMAGE_CLASSES, (size,), generator=gen))


def _sentences(gen, size):
    return (torch.randint(0, BERT_VOCAB, (size, SEQUENCE), generator=gen),
            torch.randint(0, BERT_LABELS, (size,), generator=gen))


def _text(gen, size):
    return (torch.randint(0, GPT2_VOCAB, (size, SEQUENCE), generator=gen),)


def _logits_ce(model, batch):
    x, y = batch
    return F.cross_entropy(model(x).logits, y)


def _plain_ce(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def _lm(model, batch):
    (tokens,) = batch
    return model(input_ids=tokens, labels=tokens).loss


SPECS = {
    "hf_resnet18": models.Spec(hf_resnet18, _images112, _logits_ce),
    "hf_bert": models.Spec(hf_bert, _sentences, _logits_ce),
    "hf_gpt2": models.Spec(hf_gpt2, _text, _lm),
    "tv_resnet18": models.Spec(tv_resnet18, _images112, _plain_ce),
}
# Batch sizes on one core per emulated host: a step of 0.3-0.8 s.
BENCH_BATCH = {"hf_resnet18": 16, "hf_bert": 8, "hf_gpt2": 2, "tv_resnet18": 16}
