"""A tiny random GLM-4-MoE checkpoint through calibration and 2-bit generation, end to end.

The model is built with transformers and saved as a local HF directory (config.json +
safetensors + a small word-level tokenizer.json), then driven through the same entry points
as `python -m kvjax.calibrate --model DIR ... --method wush` and
`python -m kvjax.generate --model DIR --transforms OUT/wush --bits 2`.
"""

import json

import numpy as np
import pytest
import tokenizers

from kvjax.calibrate import main as calibrate_main
from kvjax.calibrate import parse_args as calibrate_args
from kvjax.config import ModelConfig
from kvjax.generate import main as generate_main
from kvjax.generate import parse_args as generate_args
from kvjax.models.tokenizer import Tokenizer
from kvjax.storage import read_metadata

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

WORDS = (
    "the king queen lord lady crown sword night day love death fair foul sweet bitter war peace "
    "heart blood sleep dream ghost storm sea fire ring letter friend foe honour shame grief "
    "joy hope fear mercy truth"
).split()


def _tokenizer() -> Tokenizer:
    vocab = {"<unk>": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    backend.decoder = tokenizers.decoders.WordPiece(prefix="##")  # joins words with spaces
    return Tokenizer(backend, eos_ids=[1])


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory):
    cfg = transformers.Glm4MoeConfig(
        vocab_size=len(WORDS) + 2,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        partial_rotary_factor=0.5,
        attention_bias=True,
        use_qk_norm=True,
        moe_intermediate_size=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        n_shared_experts=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.0,
        max_position_embeddings=512,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    model = transformers.Glm4MoeForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(20.0)  # HF init (std 0.02) makes a near-constant model; give it some contrast
    d = tmp_path_factory.mktemp("glm4_moe_tiny")
    model.save_pretrained(d, safe_serialization=True)
    _tokenizer().save_hf_dir(d)
    rng = np.random.default_rng(0)
    text = d.parent / "calib.txt"
    text.write_text(" ".join(rng.choice(WORDS, size=2600)), encoding="utf-8")
    return d, text


def test_calibrate_then_generate_2bit(glm_dir, tmp_path, capsys):
    model_dir, text = glm_dir
    out = tmp_path / "calib"
    argv = [
        "--model",
        str(model_dir),
        "--tokens",
        "2048",
        "--seq-len",
        "128",
        "--holdout",
        "1",
        "--method",
        "wush",
        "--out",
        str(out),
        "--no-progress",
        "--data",
        str(text),
    ]
    summary = calibrate_main(calibrate_args(argv))
    assert summary["methods"]["wush"]["output_error"]  # the closing per-layer error table

    meta = read_metadata(out / "wush")
    stored = ModelConfig.from_dict(meta["model_config"])
    assert stored.model_type == "glm4_moe"
    assert stored.moe is not None and stored.moe.sparse_layers == (1,)
    assert stored.rotary_dim == stored.head_dim // 2  # transforms still act on all of head_dim

    # Small windows so the prompt actually reaches the 2-bit segment.
    prompt = " ".join(WORDS[:24])
    argv = [
        "--model",
        str(model_dir),
        "--transforms",
        str(out / "wush"),
        "--bits",
        "2",
        "--max-new-tokens",
        "4",
        "--prompt",
        prompt,
        "--sink",
        "4",
        "--keep",
        "4",
        "--flush",
        "4",
        "--page-size",
        "4",
    ]
    capsys.readouterr()
    generated = generate_main(generate_args(argv))
    printed = capsys.readouterr()
    assert "2-bit" in printed.err and "transforms=wush" in printed.err
    assert printed.out.startswith(prompt)
    new_words = generated[0].split()
    assert 1 <= len(new_words) <= 4 and set(new_words) <= set(WORDS) | {"<eos>", "<unk>"}


def test_config_json_is_the_glm4_moe_family(glm_dir):
    """The saved config keeps the structure the port reads (guards a transformers rename)."""
    model_dir, _ = glm_dir
    hf = json.loads((model_dir / "config.json").read_text())
    cfg = ModelConfig.from_hf_dict(hf)
    assert (cfg.moe.num_experts, cfg.moe.n_group, cfg.moe.num_shared_experts) == (4, 2, 1)
