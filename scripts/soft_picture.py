"""The picture of docs/soft.md: soft coordinates and spread on two crops of scikit-image's camera.

Run: python scripts/soft_picture.py  (writes docs/images/soft.png)
"""

import numpy as np
from skimage import data

import densematch
from densematch.app.features import dense_features
from densematch.app.viz import _plt, flow_colors, save_figure

img = data.camera()[::4, ::4].astype(np.float32) / 255
a_img, b_img = img[20:84, 24:88], img[16:92, 18:96]
fa, fb = dense_features(a_img), dense_features(b_img)
s = densematch.soft_match(fa, fb, temperature=0.05)
plt = _plt()
fig, ax = plt.subplots(1, 4, figsize=(14, 3.6))
for axis, (im, title) in zip(ax[:2], ((a_img, "A"), (b_img, "B")), strict=True):
    axis.imshow(im, cmap="gray")
    axis.set_title(title, fontsize=9)
    axis.axis("off")
ax[2].imshow(flow_colors(s.coords.numpy(), b_img.shape))
ax[2].set_title("soft coords (colour: position in B)", fontsize=9)
ax[2].axis("off")
im = ax[3].imshow(s.spread.numpy(), cmap="magma")
ax[3].set_title("spread (px): flat regions spread their weight", fontsize=9)
ax[3].axis("off")
fig.colorbar(im, ax=ax[3], fraction=0.046)
fig.tight_layout()
save_figure(fig, "docs/images/soft.png")
