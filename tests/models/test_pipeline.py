"""Trigger tables in a tiny random StableDiffusionPipeline built in code, on CPU."""

import pytest
import torch

from engram.models.pipeline import (
    denoise_loss,
    eject_pipeline,
    inject_pipeline,
    pipeline_parameters,
)
from engram.models.trigger import TriggerOptions
from engram.training.concept import fit_concept

pytest.importorskip("diffusers")
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture()
def pipe(new_encoder, new_tokenizer):
    from diffusers import (
        AutoencoderKL,
        DDIMScheduler,
        StableDiffusionPipeline,
        UNet2DConditionModel,
    )

    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(8, 16), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=16,
        attention_head_dim=4, norm_num_groups=4)
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 8),
                        down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, norm_num_groups=4,
                        sample_size=16)
    sched = DDIMScheduler(num_train_timesteps=100, beta_schedule="linear", steps_offset=1,
                          clip_sample=False)
    p = StableDiffusionPipeline(vae=vae, text_encoder=new_encoder("clip"),
                                tokenizer=new_tokenizer(), unet=unet, scheduler=sched,
                                safety_checker=None, feature_extractor=None,
                                requires_safety_checker=False)
    p.set_progress_bar_config(disable=True)
    return p


def _images(pipe, prompts, seed=0):
    g = torch.Generator().manual_seed(seed)
    return pipe(prompts, num_inference_steps=3, height=16, width=16, generator=g,
                output_type="pt").images


def _conditioning(pipe, prompts):
    """The text conditioning the UNet sees: [prompts, tokens, width]."""
    with torch.no_grad():
        return pipe.encode_prompt(prompts, "cpu", 1, False)[0]


def assert_same_image(a, b):
    """Bit-identical conditioning need not give bit-identical images: on some CPUs (seen on an AMD
    EPYC, in the VAE's attention) MKL's sgemm rounds the same product differently from call to
    call, so the same pipeline on the same inputs moves a pixel by ~1 ulp."""
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", ["plain", "engram"])
def test_pipeline_uses_tables_and_leaves_other_prompts_bit_identical(pipe, kind):
    prompts = ["a photo of Zorblax", "a bold handwritten seven"]
    base, cond = _images(pipe, prompts), _conditioning(pipe, prompts)
    rts = inject_pipeline(pipe, ["Zorblax"], TriggerOptions(kind=kind))
    assert list(rts) == ["text_encoder"] and rts["text_encoder"].options.site == "last"
    torch.manual_seed(3)
    with torch.no_grad():
        for p in pipeline_parameters(rts):
            p.add_(torch.randn_like(p))
    out, new = _images(pipe, prompts), _conditioning(pipe, prompts)
    assert torch.equal(new[1], cond[1]) and not torch.equal(new[0], cond[0])
    assert_same_image(out[1], base[1])
    assert (out[0] - base[0]).abs().max() > 1e-3
    eject_pipeline(pipe)
    assert torch.equal(_conditioning(pipe, prompts), cond)
    assert_same_image(_images(pipe, prompts), base)


def test_training_moves_only_the_tables(pipe):
    rts = inject_pipeline(pipe, ["Zorblax"], TriggerOptions(kind="plain"))
    before = {k: v.clone() for k, v in pipe.unet.state_dict().items()}
    enc_before = {k: v.clone() for k, v in pipe.text_encoder.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    images = torch.rand(2, 3, 16, 16, generator=g) * 2 - 1
    prompts = ["a photo of Zorblax", "Zorblax on the dog"]
    curve = fit_concept(pipeline_parameters(rts), lambda s: denoise_loss(pipe, images, prompts, g),
                        steps=3, lr=1e-2, progress=False)
    assert len(curve) == 3 and all(c == c for c in curve)
    assert rts["text_encoder"].table.values.abs().sum() > 0
    assert all(torch.equal(v, before[k]) for k, v in pipe.unet.state_dict().items())
    assert all(torch.equal(v, enc_before[k]) for k, v in pipe.text_encoder.state_dict().items())


def test_denoise_loss_checks_shapes(pipe):
    with pytest.raises(ValueError, match="one prompt per image"):
        denoise_loss(pipe, torch.zeros(2, 3, 16, 16), ["a"])


def test_sd3_pipeline_reads_hidden_minus_two_and_t5(new_tokenizer):
    """SD3: tables on both CLIP encoders (at hidden_states[-2]) and on T5 (last_hidden_state)."""
    import transformers as tf
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )

    torch.manual_seed(0)
    clip = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=2, max_position_embeddings=16, eos_token_id=3, pad_token_id=0,
                bos_token_id=2, projection_dim=16)
    enc1 = tf.CLIPTextModelWithProjection(tf.CLIPTextConfig(**clip)).eval()
    enc2 = tf.CLIPTextModelWithProjection(tf.CLIPTextConfig(**clip)).eval()
    enc3 = tf.T5EncoderModel(tf.T5Config(vocab_size=32, d_model=32, d_kv=8, d_ff=32, num_layers=1,
                                         num_heads=2)).eval()
    transformer = SD3Transformer2DModel(sample_size=8, patch_size=1, in_channels=4, num_layers=1,
                                        attention_head_dim=8, num_attention_heads=2,
                                        joint_attention_dim=32, caption_projection_dim=16,
                                        pooled_projection_dim=32, out_channels=4)
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 8),
                        down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, norm_num_groups=4,
                        sample_size=16, shift_factor=0.0, scaling_factor=1.0)
    tok = new_tokenizer()
    pipe = StableDiffusion3Pipeline(transformer=transformer,
                                    scheduler=FlowMatchEulerDiscreteScheduler(),
                                    vae=vae, text_encoder=enc1, tokenizer=tok, text_encoder_2=enc2,
                                    tokenizer_2=tok, text_encoder_3=enc3, tokenizer_3=tok)
    pipe.set_progress_bar_config(disable=True)

    prompts = ["a photo of Zorblax", "a bold handwritten seven"]

    def images():
        return pipe(prompts, num_inference_steps=2, height=16, width=16,
                    generator=torch.Generator().manual_seed(0), max_sequence_length=12,
                    output_type="pt").images

    def conditioning():  # embeds, negative embeds, pooled, negative pooled
        with torch.no_grad():
            out = pipe.encode_prompt(prompts, prompts, prompts, device="cpu",
                                     num_images_per_prompt=1, do_classifier_free_guidance=False,
                                     max_sequence_length=12)
        return out[0], out[2]

    base, cond = images(), conditioning()
    rts = inject_pipeline(pipe, ["Zorblax"])
    assert {k: rt.options.site for k, rt in rts.items()} == {
        "text_encoder": "hidden:-2", "text_encoder_2": "hidden:-2", "text_encoder_3": "last"}
    with torch.no_grad():
        for p in pipeline_parameters(rts):
            p.add_(torch.randn_like(p))
    out = images()
    (embeds, pooled), (embeds0, pooled0) = conditioning(), cond
    assert torch.equal(embeds[1], embeds0[1]) and torch.equal(pooled[1], pooled0[1])
    assert not torch.equal(embeds[0], embeds0[0])
    assert_same_image(out[1], base[1])
    assert (out[0] - base[0]).abs().max() > 1e-3
