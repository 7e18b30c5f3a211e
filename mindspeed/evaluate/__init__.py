"""`python -m mindspeed.evaluate`: loss and perplexity of either trainer's checkpoint on a
validation split, as that trainer computes its validation loss. See docs/generate-and-evaluate.md."""
