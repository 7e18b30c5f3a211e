"""Every flag a user can type: MindSpeed's own (`mindspeed_flags`), the Megatron flags the
built-in trainers take (`trainer_flags`), and the checks across them (`checks`)."""
