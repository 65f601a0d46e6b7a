"""Writes the example data sets that examples/hospitals-tabular.yaml and
examples/digits-imagefolder.yaml read, as a federation's members would hold them.

- ``hospitals/hospital-<i>/records.parquet`` (and ``records.csv``): scikit-learn's breast-cancer
  table (569 patients, 30 measurements, diagnosis malignant or benign), dealt to four hospitals
  with skewed sizes and case mixes (a Dirichlet draw per diagnosis, seeded), one Parquet file
  per hospital. Each hospital holds out its own test rows (spec.data.testFraction).
- ``digits-images/client-<i>/{train,test}/<digit>/<n>.png``: scikit-learn's 1,797 8x8 digits as
  grey PNG files, one folder per label, dealt to five clients (IID), each with its own train and
  test folders.

Run it once (``hack/setup.sh`` does): ``python examples/make_data.py [--out examples/data]``.
It rewrites nothing that is already there unless ``--force``.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import numpy as np

HOSPITALS = 4
DIGIT_CLIENTS = 5
SEED = 7


def hospitals(out: Path) -> None:
    """The breast-cancer table as one Parquet (and CSV) file per hospital."""
    import pyarrow as pa
    import pyarrow.csv as csv
    import pyarrow.parquet as pq
    from sklearn.datasets import load_breast_cancer

    table = load_breast_cancer()
    names = [str(name) for name in table.target_names]
    rng = np.random.default_rng(SEED)
    shares = rng.dirichlet(np.full(HOSPITALS, 1.0), size=len(names))
    owner = np.empty(len(table.target), dtype=np.int64)
    for label in range(len(names)):
        rows = rng.permutation(np.flatnonzero(table.target == label))
        cuts = (np.cumsum(shares[label])[:-1] * len(rows)).astype(int)
        for hospital, part in enumerate(np.split(rows, cuts)):
            owner[part] = hospital
    for hospital in range(HOSPITALS):
        rows = np.flatnonzero(owner == hospital)
        columns = {
            str(name): pa.array(table.data[rows, column])
            for column, name in enumerate(table.feature_names)
        }
        columns["diagnosis"] = pa.array([names[label] for label in table.target[rows]])
        frame = pa.table(columns)
        folder = out / "hospitals" / f"hospital-{hospital}"
        folder.mkdir(parents=True, exist_ok=True)
        pq.write_table(frame, folder / "records.parquet")
        csv_folder = out / "hospitals-csv" / f"hospital-{hospital}"
        csv_folder.mkdir(parents=True, exist_ok=True)
        csv.write_csv(frame, csv_folder / "records.csv")
        counts = np.bincount(table.target[rows], minlength=len(names))
        print(
            f"hospital-{hospital}: {len(rows)} patients "
            + ", ".join(f"{count} {name}" for name, count in zip(names, counts, strict=True))
        )


def digit_images(out: Path) -> None:
    """The 8x8 digits as PNG folders, one per client, with train and test folders."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    pixels = np.clip(digits.images * 16, 0, 255).astype(np.uint8)  # 0..16 -> 0..255
    rng = np.random.default_rng(SEED)
    order = rng.permutation(len(digits.target))
    for client, rows in enumerate(np.array_split(order, DIGIT_CLIENTS)):
        test = round(0.2 * len(rows))
        for part, part_rows in (("test", rows[:test]), ("train", rows[test:])):
            for row in part_rows:
                folder = out / "digits-images" / f"client-{client}" / part / str(digits.target[row])
                folder.mkdir(parents=True, exist_ok=True)
                Image.fromarray(pixels[row], mode="L").save(folder / f"{row}.png")
        print(f"client-{client}: {len(rows) - test} training and {test} test images")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "data")
    parser.add_argument("--force", action="store_true", help="rewrite data that is there")
    args = parser.parse_args()
    for name, write in (("hospitals", hospitals), ("digits-images", digit_images)):
        if (args.out / name).exists():
            if not args.force:
                print(f"{args.out / name} is there (--force rewrites it).")
                continue
            shutil.rmtree(args.out / name)
            if name == "hospitals":
                shutil.rmtree(args.out / "hospitals-csv", ignore_errors=True)
        write(args.out)


if __name__ == "__main__":
    main()
