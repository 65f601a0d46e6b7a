"""Learning helpers shared by every protocol: datasets and partitions (``data``), models and
their weights (``models``), local training and evaluation (``training``), and the poisoning
attacks of the robust-aggregation baselines (``poisoning``)."""
