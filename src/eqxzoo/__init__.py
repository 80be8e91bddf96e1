"""eqxzoo: pure Equinox building blocks and the machinery to train them at scale."""
