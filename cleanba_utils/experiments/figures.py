"""Figures without a display: matplotlib's Agg backend, and how every figure is saved."""

import matplotlib
import matplotlib.pyplot as plt

matplotlib.use("Agg")


def save_figure(fig, path):
    fig.savefig(path, dpi=120)
    plt.close(fig)
