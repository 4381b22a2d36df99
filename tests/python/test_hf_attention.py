# transformers with attn_implementation="t3d": a tiny Llama (GQA) saved and reloaded gives the eager logits and
# gradients; causal batches without padding run as causal; masks t3d cannot express raise.
import pytest
import torch

transformers = pytest.importorskip("transformers")

import t3d.hf  # noqa: E402


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    d = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(d)
    return d


def _load(path, impl):
    from transformers import LlamaForCausalLM

    m = LlamaForCausalLM.from_pretrained(path, attn_implementation=impl, torch_dtype=torch.float32)
    assert m.config._attn_implementation == impl
    return m


def test_logits_and_grads_match_eager(llama_dir):
    ids = torch.randint(0, 256, (2, 37), generator=torch.Generator().manual_seed(1))
    ref = _load(llama_dir, "eager")
    got = _load(llama_dir, "t3d")
    out_ref = ref(input_ids=ids, labels=ids)
    out_got = got(input_ids=ids, labels=ids)
    torch.testing.assert_close(out_got.logits, out_ref.logits, atol=1e-4, rtol=1e-4)
    out_ref.loss.backward()
    out_got.loss.backward()
    for (name, p), q in zip(got.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-3, msg=lambda m: f"{name}: {m}")


def test_generate_with_kv_cache_matches_eager(llama_dir):
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(2))
    ref = _load(llama_dir, "eager").generate(ids, max_new_tokens=6, do_sample=False)
    got = _load(llama_dir, "t3d").generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(ref, got)


def test_explicit_all_ones_mask_is_causal(llama_dir):
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    m = _load(llama_dir, "t3d")
    a = m(input_ids=ids).logits
    b = m(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    torch.testing.assert_close(a, b)


def test_padding_mask_raises(llama_dir):
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    m = _load(llama_dir, "t3d")
    with pytest.raises(ValueError, match="neither causal nor all-visible"):
        m(input_ids=ids, attention_mask=mask)


def test_mask_conversion_unit():
    from t3d.hf import _mask_to_causal

    causal = torch.ones(5, 8, dtype=torch.bool).tril(3)[None, None]
    assert _mask_to_causal(causal, 5, 8) == (True, 3)
    assert _mask_to_causal(torch.ones(1, 1, 5, 8, dtype=torch.bool), 5, 8) == (False, 0)
    additive = torch.zeros(1, 1, 4, 4).masked_fill(~torch.ones(4, 4, dtype=torch.bool).tril(), float("-inf"))
    assert _mask_to_causal(additive, 4, 4) == (True, 0)
    with pytest.raises(ValueError, match="attention biases"):
        _mask_to_causal(torch.randn(1, 1, 4, 4), 4, 4)
