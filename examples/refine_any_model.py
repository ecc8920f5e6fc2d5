"""Method B on a model dualseg did not build: an smp Unet, refined on its own features.

    pip install "dualseg[smp]"
    python examples/refine_any_model.py        # under a minute on a laptop CPU

1. The base: segmentation_models_pytorch's Unet with a MobileNetV2 encoder initialized from
   the ImageNet weights dualseg ships offline, trained briefly on synthetic street scenes.
   Bring your own trained model here instead: anything returning logits [B,C,h,w].
2. Method B fitted on the base's own features: its encoder's stride-4 and stride-16 stages
   (``base_features="auto"`` finds them; ``dualseg refine layers`` lists every candidate).
3. Refined predictions: the base runs once per batch and the refiner reads its features.
"""

import segmentation_models_pytorch as smp
import torch

from dualseg.data import build_dataset, build_eval_transform, make_synthetic_dataset
from dualseg.refine import BoundaryRefiner, RefinerConfig
from dualseg.weights import load_state_dict_file, resolve_weights

torch.manual_seed(0)
root = make_synthetic_dataset("example_data", n_train=12, n_val=4, size=(64, 96))
train = build_dataset(root, split="train", transform=build_eval_transform())
val = build_dataset(root, split="val", transform=build_eval_transform())
classes = train.meta.class_names

# 1. a base model (here trained for a few steps; yours is already trained)
base = smp.Unet("mobilenet_v2", encoder_weights=None, classes=len(classes))
base.encoder.load_state_dict(load_state_dict_file(resolve_weights("mobilenet_v2")))
opt = torch.optim.Adam(base.parameters(), lr=1e-3)
loader = torch.utils.data.DataLoader(train, batch_size=4, shuffle=True)
for _ in range(3):
    for images, labels in loader:
        loss = torch.nn.functional.cross_entropy(base(images), labels, ignore_index=255)
        opt.zero_grad()
        loss.backward()
        opt.step()
base.eval()

# 2. method B on the base's own features (frozen; only the refiner's ASPP and decoder learn)
config = RefinerConfig(embed_dim=32, decoder_channels=48, steps=20, batch_size=4, top_n=3)
refiner = BoundaryRefiner.fit(train, class_names=classes, config=config, base=base,
                              base_features="auto", weights=None, progress=False)  # fmt: skip
print(refiner)

# 3. refine: the base runs once, the refiner reads its features
images, labels = next(iter(torch.utils.data.DataLoader(val, batch_size=4)))
refined, changed = refiner.refine(images, base=base, return_changed=True)
with torch.no_grad():
    before = base(images).argmax(1)
valid = labels != 255
print(f"pixel accuracy {100 * (before == labels)[valid].float().mean():.1f}% -> "
      f"{100 * (refined == labels)[valid].float().mean():.1f}%, "
      f"{int(changed.sum())} pixels changed")  # fmt: skip
refiner.save("example_refiner.pt")  # BoundaryRefiner.load() it; give it the same base
