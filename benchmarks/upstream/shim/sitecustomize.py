"""Offline stand-ins for the hub: a tiny BERT built from a config, a word-level tokenizer."""
import os, tempfile
import transformers

_VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(200)]


def _tokenizer(*a, **k):
    path = os.path.join(tempfile.gettempdir(), f"shim_vocab_{os.getpid()}.txt")
    with open(path, "w") as f:
        f.write("\n".join(_VOCAB))
    return transformers.BertTokenizer(path, do_lower_case=False)


def _model(*a, **k):
    cfg = transformers.BertConfig(vocab_size=len(_VOCAB), hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, intermediate_size=64, num_labels=2,
                                  max_position_embeddings=64)
    return transformers.BertForSequenceClassification(cfg)


transformers.AutoTokenizer.from_pretrained = staticmethod(_tokenizer)
transformers.AutoModelForSequenceClassification.from_pretrained = staticmethod(_model)
