"""Training drafts on the target's own answers: data, cached features, one training loop, trainers."""
