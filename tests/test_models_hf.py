"""transformers models by name, offline (issue 13): ``hf:TYPE[:HEAD]`` and ``config.json``.

The summary's MACs of small GPT-2, BERT, ViT and LLaMA models equal a count written here
from the config (projections, QK^T and AV, MLP or gated MLP, heads) within 1%; the
parameters equal ``sum(p.numel())`` with tied embeddings once; bad input is one line.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

pytest.importorskip("transformers")

from torch_tricks.cli import main  # noqa: E402
from torch_tricks.errors import UserError  # noqa: E402
from torch_tricks.inspect import summary  # noqa: E402
from torch_tricks.models import load_model  # noqa: E402

B, T = 2, 32

GPT2 = {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 500, "n_positions": 64}
BERT = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 2, "intermediate_size": 128,
        "vocab_size": 500, "max_position_embeddings": 64}
VIT = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 2, "intermediate_size": 128,
       "image_size": 32, "patch_size": 8, "num_channels": 3}
LLAMA = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 160, "vocab_size": 500, "max_position_embeddings": 64}


def tokens(vocab: int, batch: int = B, seq: int = T) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))


def attention(t: int, d: int) -> int:
    """QK^T and AV over all heads: 2 * T^2 * (heads * head_dim); causal masks do not halve it."""
    return 2 * t * t * d


def check_params(model, s) -> None:
    distinct = sum(p.numel() for p in model.parameters())
    assert s.totals["params"] == distinct


# -- MACs against the analytic count ------------------------------------------------------

def test_gpt2_macs_and_params():
    model, default = load_model("hf:gpt2", hf_config=GPT2)
    assert type(model).__name__ == "GPT2LMHeadModel" and default == "long:64:500"
    cfg = model.config
    L, d, V = cfg.n_layer, cfg.n_embd, cfg.vocab_size
    per_layer = 4 * T * d * d + attention(T, d) + 2 * T * d * (4 * d)  # QKV+O, attention, MLP d->4d->d
    expected = B * (L * per_layer + T * d * V)  # + LM head
    s = summary(model, tokens(V))
    assert s.totals["macs"] == pytest.approx(expected, rel=0.01)
    check_params(model, s)
    # the LM head is tied to the token embedding: counted once
    assert model.lm_head.weight is model.transformer.wte.weight
    with_dupes = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    assert s.totals["params"] == with_dupes - V * d


def test_bert_masked_lm_macs_and_params():
    model, default = load_model("hf:bert", hf_config=BERT)
    assert type(model).__name__ == "BertForMaskedLM" and default == "long:64:500"
    cfg = model.config
    L, d, V, inter = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size
    per_layer = 4 * T * d * d + attention(T, d) + 2 * T * d * inter
    head = T * d * d + T * d * V  # MLM transform dense, then the decoder (tied); no pooler in BertForMaskedLM
    expected = B * (L * per_layer + head)
    s = summary(model, tokens(V))
    assert s.totals["macs"] == pytest.approx(expected, rel=0.01)
    check_params(model, s)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


def test_bert_classification_head_counts_the_pooler():
    model, _ = load_model("hf:bert:classification", hf_config=BERT)
    assert type(model).__name__ == "BertForSequenceClassification"
    cfg = model.config
    L, d, inter, labels = cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_labels
    per_layer = 4 * T * d * d + attention(T, d) + 2 * T * d * inter
    expected = B * (L * per_layer + d * d + d * labels)  # pooler (CLS token) + classifier
    s = summary(model, tokens(cfg.vocab_size))
    assert s.totals["macs"] == pytest.approx(expected, rel=0.01)
    check_params(model, s)


def test_vit_image_classification_macs_and_params():
    model, default = load_model("hf:vit", hf_config=VIT)
    assert type(model).__name__ == "ViTForImageClassification" and default == "3x32x32"
    cfg = model.config
    L, d, inter, P, C = cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, cfg.patch_size, cfg.num_channels
    patches = (cfg.image_size // P) ** 2
    t = patches + 1  # + the CLS token
    per_layer = 4 * t * d * d + attention(t, d) + 2 * t * d * inter
    expected = B * (patches * C * P * P * d + L * per_layer + d * cfg.num_labels)  # patch conv, layers, CLS classifier
    s = summary(model, torch.randn(B, C, cfg.image_size, cfg.image_size))
    assert s.totals["macs"] == pytest.approx(expected, rel=0.01)
    check_params(model, s)


def test_llama_gqa_gated_mlp_macs_and_params():
    model, default = load_model("hf:llama", hf_config=LLAMA)
    assert type(model).__name__ == "LlamaForCausalLM" and default == "long:64:500"
    cfg = model.config
    L, d, V, inter = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size
    hd, H, KV = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    assert hd == d // H and KV < H
    per_layer = (T * d * H * hd + 2 * T * d * KV * hd + T * H * hd * d  # q, k, v (grouped), o
                 + attention(T, H * hd)  # every query head attends: GQA shares K/V, not the work
                 + 3 * T * d * inter)  # gate, up, down
    # The rotary angles (positions x inv_freq, T x hd/2) are an element-wise product in transformers 5: no
    # MACs. transformers 4.x writes them as a (hd/2 x 1) @ (1 x T) matmul: hd/2 * T MACs, 0.003% here.
    expected = B * (L * per_layer + T * d * V)  # untied LM head
    s = summary(model, tokens(V))
    assert s.totals["macs"] == pytest.approx(expected, rel=0.01)
    check_params(model, s)


@pytest.mark.parametrize("ref,cfg", [("hf:gpt2", GPT2), ("hf:llama", LLAMA)])
def test_eager_and_sdpa_attention_count_the_same(ref, cfg):
    x = tokens(cfg["vocab_size"])
    macs = {}
    for impl in ("eager", "sdpa"):
        model, _ = load_model(ref, hf_config={**cfg, "attn_implementation": impl})
        assert model.config._attn_implementation == impl
        macs[impl] = summary(model, x).totals["macs"]
    assert macs["eager"] == macs["sdpa"]


# -- heads, inputs, config files ----------------------------------------------------------

def test_t5_runs_on_one_token_input_with_shifted_decoder_ids():
    model, default = load_model("hf:t5", hf_config={"num_layers": 1, "num_decoder_layers": 1, "d_model": 32,
                                                    "d_ff": 64, "d_kv": 8, "num_heads": 2, "vocab_size": 100})
    assert type(model).__name__ == "T5ForConditionalGeneration" and default == "long:128:100"
    model.eval()
    x = tokens(100, seq=8)
    with torch.no_grad():
        out = model(x)
        start = getattr(model.config, "decoder_start_token_id", None)
        start = model.config.pad_token_id if start is None else start  # T5 starts decoding with its pad token
        shifted = torch.cat([torch.full((B, 1), start), x[:, :-1]], dim=1)
        ref = model(x, decoder_input_ids=shifted)
        other = model(x, decoder_input_ids=x[:, :3])  # given ids are kept
    assert out.logits.shape == (B, 8, 100)
    torch.testing.assert_close(out.logits, ref.logits)
    assert other.logits.shape == (B, 3, 100)
    assert summary(model, x).totals["macs"] > 0


def test_built_models_have_no_cache_unless_asked():
    model, _ = load_model("hf:gpt2", hf_config=GPT2)
    assert model.config.use_cache is False
    assert model.config.n_layer == 2 and model.config.num_hidden_layers == 2
    model, _ = load_model("hf:gpt2", hf_config={**GPT2, "use_cache": True, "num_hidden_layers": 1})
    assert model.config.use_cache is True and model.config.n_layer == 1  # attribute_map aliases work too


def test_hf_config_string_values_are_typed():
    from torch_tricks.models.hf import parse_hf_config

    assert parse_hf_config("n_layer=4, n_embd=256,resid_pdrop=0.5,use_cache=true,activation_function=gelu") == {
        "n_layer": 4, "n_embd": 256, "resid_pdrop": 0.5, "use_cache": True, "activation_function": "gelu"}
    model, _ = load_model("hf:llama", hf_config="num_hidden_layers=1,hidden_size=32,num_attention_heads=2,"
                                                "intermediate_size=64,vocab_size=100")
    assert model.config.head_dim == 16  # derived from the overrides, not left at the 4096/32 default


def test_config_json_file_and_folder(tmp_path):
    cfg = {"model_type": "bert", **BERT}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model, default = load_model(str(tmp_path / "config.json"))
    assert type(model).__name__ == "BertForMaskedLM" and default == "long:64:500"
    model, _ = load_model(f"{tmp_path / 'config.json'}:classification", hf_config={"num_labels": 3})
    assert type(model).__name__ == "BertForSequenceClassification" and model.classifier.out_features == 3
    model, _ = load_model(f"{tmp_path}:base")
    assert type(model).__name__ == "BertModel" and model.config.num_hidden_layers == 2


def test_models_command_lists_hf_families(capsys):
    assert main(["models", "--json"]) == 0
    rows = {m["name"]: m["input"] for m in json.loads(capsys.readouterr().out)["models"]}
    assert rows["hf:gpt2"] == "long:128:50257" and rows["hf:vit"] == "3x224x224"
    assert {"hf:bert", "hf:llama", "hf:t5", "resnet18"} <= set(rows)


def test_cli_summary_of_a_small_gpt2(capsys):
    code = main(["summary", "--model", "hf:gpt2", "--hf-config", "n_layer=2,n_embd=64,n_head=2",
                 "--input", "long:32:50257", "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    data = json.loads(captured.out)
    d, V = 64, 50257
    assert data["totals"]["macs"] == 2 * (4 * T * d * d + attention(T, d) + 8 * T * d * d) + T * d * V
    assert data["inputs"] == "(1, 32) int64"


# -- bad input: one line ------------------------------------------------------------------

BAD = [
    (["--model", "hf:gpt3"], "unknown transformers model type 'gpt3' (did you mean"),
    (["--model", "hf:gpt2:speech"], "unknown head 'speech'"),
    (["--model", "hf:gpt2:image-classification"], "has no image-classification head"),
    (["--model", "hf:gpt2", "--hf-config", "n_layers=2"], "unknown --hf-config key 'n_layers'"),
    (["--model", "hf:gpt2", "--hf-config", "n_layer"], "bad --hf-config item 'n_layer'"),
    (["--model", "no/such/dir/config.json"], "no config file 'no/such/dir/config.json'"),
    (["--model", "mlp", "--hf-config", "n_layer=2"], "--hf-config applies only to transformers models"),
]


@pytest.mark.parametrize("args,message", BAD, ids=[a[1] for a, _ in BAD])
def test_bad_input_is_one_line(capsys, args, message):
    assert main(["summary", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_bad_input_from_python_is_a_user_error():
    with pytest.raises(UserError, match="unknown head 'speech'.*causal-lm, masked-lm"):
        load_model("hf:gpt2:speech")
    with pytest.raises(UserError, match="unknown --hf-config key 'n_layers' for GPT2Config"):
        load_model("hf:gpt2", hf_config={"n_layers": 2})


def test_missing_transformers_names_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    with pytest.raises(UserError, match=r'pip install "torch-tricks\[hf\]"'):
        load_model("hf:gpt2")
    assert main(["summary", "--model", "hf:gpt2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and 'pip install "torch-tricks[hf]"' in err
    assert main(["models", "--json"]) == 0  # the listing still works, and says what to install
    names = [m["name"] for m in json.loads(capsys.readouterr().out)["models"]]
    assert "hf:TYPE[:HEAD]" in names and "resnet18" in names


def test_a_model_larger_than_the_memory_is_refused_before_it_is_built(monkeypatch, capsys):
    from torch_tricks.models import hf

    model, _ = load_model("hf:gpt2", hf_config={**GPT2, "n_layer": 1})
    need = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    monkeypatch.setattr(hf, "_available_bytes", lambda: need - 1)
    with pytest.raises(UserError, match=r"has \S+ parameters, 0\.0 GiB of weights: more than the 0\.0 GiB of memory"):
        load_model("hf:gpt2", hf_config={**GPT2, "n_layer": 1})
    monkeypatch.setattr(hf, "_available_bytes", lambda: need)
    load_model("hf:gpt2", hf_config={**GPT2, "n_layer": 1})  # just fits
    monkeypatch.setattr(hf, "_available_bytes", lambda: 8 * 2**30)
    assert main(["summary", "--model", "hf:llama"]) == 2  # LLaMA-7B's default config, sized on the meta device
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "6.74e+09 parameters, 25.1 GiB of weights" in err and "--hf-config" in err


def test_grouped_query_attention_is_counted_with_torchs_older_attention_formula(monkeypatch):
    """torch 2.11 (a GPU machine's image) refused GQA in its attention formula: 'query/key/value shapes are
    incompatible', and the summary of any Llama-family model failed. The count equals the one torch 2.13 gives."""
    import torch.utils.flop_counter as fc

    from torch_tricks.inspect import flops as flops_mod

    model, _ = load_model("hf:llama", hf_config=LLAMA)
    x = tokens(LLAMA["vocab_size"])
    expected = summary(model, x).totals["macs"]

    def strict(q, k, v):  # torch < 2.13: as many key/value heads as query heads
        assert q[1] == k[1] == v[1], "sdpa_flop_count: query/key/value shapes are incompatible"
        return fc.sdpa_flop_count(q, k, v)

    monkeypatch.setattr(flops_mod, "sdpa_flop_count", strict)
    assert summary(model, x).totals["macs"] == expected
