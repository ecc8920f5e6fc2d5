"""Method B on the base's own backbone output (dualseg.refine.shared): same labels, one backbone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dualseg.models import build_model
from dualseg.refine import BoundaryRefiner, RefinerConfig
from dualseg.refine.decision import prototype_scale, prototype_scores
from dualseg.refine.embedding import init_backbone_from
from dualseg.refine.fit import embedding_net
from dualseg.refine.shared import SharedFeatures, base_backbone

K = 4


def refiner_on(model: torch.nn.Module, **options: object) -> BoundaryRefiner:
    options = {"embed_dim": 8, "backbone_source": "base-frozen", "input_scale": 1.0, **options}
    cfg = RefinerConfig(radius=2, **options)
    net = embedding_net(cfg)
    backbone = base_backbone(model)
    assert backbone is not None
    assert init_backbone_from(net.backbone, model) == len(net.backbone.state_dict())
    g = torch.Generator().manual_seed(0)
    protos = torch.randn(K, 8, generator=g)
    return BoundaryRefiner(
        net, protos, torch.ones(K, dtype=torch.bool), class_names=list("abcd"), config=cfg
    )


@torch.no_grad()
def with_statistics(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` in eval mode with BatchNorm statistics of random images: untrained, its
    eval-mode features would vanish (about 1e-9 after MobileNetV2's 17 blocks), and every
    embedding would look alike."""
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.momentum = None  # a cumulative average: one pass gives that batch's statistics
    model.train()(torch.randn(4, 3, 64, 96, generator=torch.Generator().manual_seed(3)))
    return model.eval()


@pytest.fixture(scope="module")
def peer() -> torch.nn.Module:
    torch.manual_seed(0)
    return with_statistics(build_model("deeplabv3_mobilenet_v2", num_classes=K, output_stride=16))


def images(h: int, w: int) -> torch.Tensor:
    return torch.randn(2, 3, h, w, generator=torch.Generator().manual_seed(1))


def class_scores(h: int, w: int) -> torch.Tensor:
    """Scores with regions and boundaries (an untrained base predicts one class everywhere)."""
    coarse = torch.randn(2, K, 4, 6, generator=torch.Generator().manual_seed(2)) * 4
    return F.interpolate(coarse, size=(h, w), mode="bilinear", align_corners=False)


@torch.no_grad()
def test_shared_features_give_the_refiners_own_labels(peer: torch.nn.Module) -> None:
    refiner = refiner_on(peer)
    x = images(64, 96)  # sides multiples of the stride: no padding, the same embedding
    with refiner.shared_features(peer) as shared:
        peer(x)
        features = shared.take()
    assert features is not None and features[1] == (64, 96)
    logits = class_scores(64, 96)
    own = refiner.candidates(x, logits)
    mine = refiner.candidates(x, logits, features=features)
    assert own.edge.any()
    torch.testing.assert_close(mine.distance, own.distance, rtol=1e-5, atol=1e-5)
    labels, changed = refiner.refine(x, logits, return_changed=True, features=features)
    ref_labels, ref_changed = refiner.refine(x, logits, return_changed=True)
    assert torch.equal(labels, ref_labels) and torch.equal(changed, ref_changed)


@torch.no_grad()
def test_padded_input_is_sampled_where_the_base_saw_it(peer: torch.nn.Module) -> None:
    refiner = refiner_on(peer)
    x = images(56, 90)  # the base pads to 64x96 at stride 16
    with refiner.shared_features(peer) as shared:
        peer(x)
        features = shared.take()
    assert features is not None and features[1] == (64, 96)
    assert features[0].std() > 0.01  # features that vary: a wrong geometry would show
    logits = class_scores(56, 90)
    assert logits.shape[-2:] == x.shape[-2:]
    c = refiner.candidates(x, logits, features=features)
    # the score map upsampled to the padded size, then cropped: the base's own geometry
    scores = prototype_scores(refiner.net.fuse(features[0]), refiner.prototypes)
    full = F.interpolate(scores, size=(64, 96), mode="bilinear", align_corners=False)
    assert c.edge.any()
    rows = full[..., :56, :90].permute(0, 2, 3, 1)[c.edge]  # [M,K]
    expected = rows.gather(1, c.labels) / prototype_scale(refiner.prototypes, refiner.present)
    torch.testing.assert_close(c.distance, expected, rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_nothing_is_shared_where_it_would_change_the_answer(peer: torch.nn.Module) -> None:
    x = images(64, 96)
    blur = refiner_on(peer, p1_blur_sigma=1.0)  # P1 filters the refiner's input, not the base's
    half = refiner_on(peer, input_scale=0.5)  # the base saw the image at scale 1
    stride8 = refiner_on(peer, output_stride=8)  # the same weights, dilated otherwise
    other = with_statistics(build_model("deeplabv3_mobilenet_v2", num_classes=K, output_stride=16))
    fit_elsewhere = refiner_on(other)  # fit on another base: other backbone weights
    for refiner in (blur, half, stride8, fit_elsewhere):
        with refiner.shared_features(peer) as shared:
            peer(x)
            assert shared.take() is None
    ok = refiner_on(peer)
    with ok.shared_features(peer) as shared:
        peer(x)
        peer(x.flip(-1))  # two forwards (test-time augmentation): which one? share neither
        assert shared.take() is None
        peer(x)
        assert shared.take() is not None  # take() forgets: the next forward shares again
    peer(x)  # outside the block the hook is gone
    assert shared.take() is None
    with pytest.raises(Exception, match="P1 blur"), ok.shared_features(peer) as shared:
        logits = peer(x)
        ok.candidates(x, logits, features=shared.take(), p1_blur_sigma=1.0)


@torch.no_grad()
def test_a_weight_changed_after_a_shared_call_stops_the_sharing() -> None:
    torch.manual_seed(0)
    model = with_statistics(build_model("deeplabv3_mobilenet_v2", num_classes=K, output_stride=16))
    refiner = refiner_on(model)
    x = images(64, 96)
    for step in ("same weights", "a weight written in place", "the weight put back"):
        if step != "same weights":  # as an optimizer step or load_state_dict would
            next(model.backbone.parameters()).mul_(2.0 if "written" in step else 0.5)
        with refiner.shared_features(model) as shared:
            model(x)
            shared_now = shared.take() is not None
        assert shared_now == (step != "a weight written in place"), step


@torch.no_grad()
def test_method_a_shares_its_rgb_branch() -> None:
    torch.manual_seed(0)
    model = with_statistics(
        build_model("dualseg_mobilenet_v2", num_classes=K, output_stride=16, renet_hidden=8)
    )
    refiner = refiner_on(model)
    x = images(64, 96)
    with refiner.shared_features(model) as shared:
        model(x)
        features = shared.take()  # the RGB branch's backbone, not the grey one
    assert features is not None
    with torch.no_grad():
        torch.testing.assert_close(features[0], model.rgb.backbone(x))
    logits = class_scores(64, 96)
    labels = refiner.refine(x, logits, features=features)
    assert torch.equal(labels, refiner.refine(x, logits))


class OwnBackbone:
    """The same refiner without the shared path: what ``evaluate`` gave before."""

    def __init__(self, refiner: BoundaryRefiner) -> None:
        self.inner = refiner

    def refine(self, images, probs, return_changed=True):
        return self.inner.refine(images, probs, return_changed=return_changed)


def test_evaluate_reads_the_base_features_with_the_same_result(peer: torch.nn.Module) -> None:
    from dualseg.engine.evaluation import evaluate, format_metrics

    refiner = refiner_on(peer)
    x = images(64, 96)
    with torch.no_grad():
        labels = peer(x).argmax(1).flip(-1)  # ground truth that differs from the base
    loader = [(x, labels)]
    seen: list[object] = []
    take = SharedFeatures.take

    def spy(self, images=None):
        kept = take(self, images)
        seen.append(kept)
        return kept

    options = {"num_classes": K, "device": "cpu"}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(SharedFeatures, "take", spy)
        shared = evaluate(peer, loader, refiner=refiner, **options)
    own = evaluate(peer, loader, refiner=OwnBackbone(refiner), **options)
    assert len(seen) == 1 and seen[0] is not None  # the base's features were passed on
    assert shared["refine"]["shared_images"] == len(x) and own["refine"]["shared_images"] == 0
    assert "on the base's features for 2 of 2 images" in format_metrics(shared)
    assert "base's features" not in format_metrics(own)
    assert shared["refine"]["changed"] > 0
    for key in ("changed", "fixed", "broke"):
        assert shared["refine"][key] == own["refine"][key], key
    assert shared["refined"]["miou"] == own["refined"]["miou"]


def test_decision_sweep_reads_the_base_features_as_evaluate_will(peer: torch.nn.Module) -> None:
    from dualseg.refine.calibrate import decision_grid, sweep_decision

    refiner = refiner_on(peer)
    x = images(64, 96)
    with torch.no_grad():
        labels = peer(x).argmax(1).flip(-1)
    grid = decision_grid(gates=(None, 0.5), priors=(0.0,), min_probs=(0.0,), blur_sigmas=(0, 1))
    options = {"num_classes": K, "grid": grid}
    base = lambda t: peer(t).softmax(1)  # noqa: E731
    own = sweep_decision(refiner, base, [(x, labels)], **options)
    taken: list[object] = []
    with refiner.shared_features(peer) as shared:

        class Spy:
            def take(self, images: torch.Tensor) -> object:
                taken.append(shared.take(images))
                return taken[-1]

        rows = sweep_decision(refiner, base, [(x, labels)], shared=Spy(), **options)
    assert len(taken) == 1 and taken[0] is not None
    assert rows == own  # no padding at 64x96: the same embedding either way
    assert any(r["changed"] > 0 for r in rows if r["gate_margin"] != "base")


@torch.no_grad()
def test_features_of_other_images_are_not_used(peer: torch.nn.Module) -> None:
    refiner = refiner_on(peer)
    x = images(64, 96)
    with refiner.shared_features(peer) as shared:
        peer(x)
        kept = shared.take()
    assert kept is not None
    logits = class_scores(64, 96)
    own = refiner.candidates(x, logits)
    feats, covered = kept.features, kept.covered
    for wrong in (
        (feats[:1], covered),  # one image's features for a batch of two
        (F.interpolate(feats, scale_factor=1.5), (96, 144)),  # a resized input (TTA)
        (feats.bfloat16(), covered),  # autocast's half precision
    ):
        c = refiner.candidates(x, logits, features=wrong)  # the refiner's own backbone instead
        torch.testing.assert_close(c.distance, own.distance)
    # take(images) hands over only what matches them, so a count of shared images is true
    with refiner.shared_features(peer) as shared:
        peer(x)
        assert shared.take(x) is not None
        peer(x)
        assert shared.take(x[:1]) is None  # a batch of two for one image
        peer(x)
        assert shared.take(F.interpolate(x, scale_factor=0.5)) is None  # another input size


@torch.no_grad()
def test_an_image_without_boundaries_beside_one_with_them(peer: torch.nn.Module) -> None:
    refiner = refiner_on(peer)
    x = images(64, 96)
    logits = class_scores(64, 96)
    logits[1] = 0
    logits[1, 2] = 1  # the second image is one class: no near-boundary pixel
    with refiner.shared_features(peer) as shared:
        peer(x)
        kept = shared.take()
    mine = refiner.candidates(x, logits, features=kept)
    own = refiner.candidates(x, logits)
    assert mine.edge[0].any() and not mine.edge[1].any()
    torch.testing.assert_close(mine.distance, own.distance, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "inference",
    [
        {"tta_scales": (1.5,)},  # one forward, but of a resized image
        {"mode": "slide", "window": (32, 48), "stride": (32, 48), "tile_batch": 16},  # tiles
        {"tta_flip": True},  # two forwards
    ],
)
def test_evaluate_does_not_share_an_augmented_forward(
    peer: torch.nn.Module, inference: dict
) -> None:
    from dualseg.engine.evaluation import evaluate

    refiner = refiner_on(peer)
    x = images(64, 96)
    with torch.no_grad():
        labels = peer(x).argmax(1).flip(-1)
    options = {"num_classes": K, "device": "cpu", **inference}
    shared = evaluate(peer, [(x, labels)], refiner=refiner, **options)
    own = evaluate(peer, [(x, labels)], refiner=OwnBackbone(refiner), **options)
    assert shared["refine"] == {**own["refine"], "ms_per_image": shared["refine"]["ms_per_image"]}
    assert shared["refine"]["shared_images"] == 0  # reported as the refiner's own pass


def test_the_base_backbone_is_taken_whole_or_refused() -> None:
    """base-frozen / base-finetune read the base's own network: a ResNet-18 embedding matches
    the first blocks of a ResNet-34 base by name, and a ResNet-34 one finds only a ResNet-18's
    blocks: both are another network, refused (strict); the same backbone is copied whole."""
    from dualseg.errors import ConfigError

    cfg18 = RefinerConfig(embed_dim=8, backbone="resnet18")
    cfg34 = RefinerConfig(embed_dim=8, backbone="resnet34")
    base18 = build_model("deeplabv3_resnet18", num_classes=K)
    base34 = build_model("dualseg_resnet34", num_classes=K)  # its RGB branch is read
    with pytest.raises(ConfigError, match=r"120 of the embedding backbone's 120 .* holds 216"):
        init_backbone_from(embedding_net(cfg18).backbone, base34, strict=True)
    with pytest.raises(ConfigError, match=r"120 of the embedding backbone's 216 .* holds 120"):
        init_backbone_from(embedding_net(cfg34).backbone, base18, strict=True)
    net = embedding_net(cfg18)
    assert init_backbone_from(net.backbone, base18, strict=True) == 120
    for key, value in net.backbone.state_dict().items():
        assert torch.equal(value, base18.backbone.state_dict()[key]), key
