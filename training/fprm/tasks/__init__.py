"""FPRM task builders: Sudoku, mazes, group state tracking (S5, A5, ...) and ARC-AGI, and `build_task`, which
turns the data arguments into a `DatasetDict` and the model configuration the task needs."""

STATE_TRACKING_TASKS = ("s5", "a5", "s4", "a4", "s3")  # group name, lower case
TASKS = ("sudoku", "maze", *STATE_TRACKING_TASKS, "arc")


def build_task(data_args, seed):
    """(DatasetDict, config overrides, difficulty columns) for the task."""
    seed = seed + data_args.data_seed_offset
    if data_args.task == "sudoku":
        from looped_training.fprm.tasks.sudoku import build_sudoku_dataset, vocab_size

        n = data_args.sudoku_size
        ds = build_sudoku_dataset(n, data_args.num_train, data_args.num_test, seed=seed)
        return (
            ds,
            dict(vocab_size=vocab_size(n), grid_size=n, conv_type="2d", causal=False, position_embedding_type="rope"),
            ["num_blanks", "rating"],
        )
    if data_args.task == "maze":
        from looped_training.fprm.tasks.maze import VOCAB_SIZE, build_maze_dataset

        ds = build_maze_dataset(data_args.maze_size, data_args.num_train, data_args.num_test, seed=seed)
        return (
            ds,
            dict(
                vocab_size=VOCAB_SIZE,
                grid_size=data_args.maze_size,
                conv_type="causal_1d",
                causal=False,
                position_embedding_type="rope",
            ),
            ["path_length"],
        )
    if data_args.task in STATE_TRACKING_TASKS:
        from looped_training.fprm.tasks.state_tracking import build_state_tracking_dataset, vocab_size

        group = data_args.task.upper()
        ds = build_state_tracking_dataset(
            group,
            data_args.num_train,
            data_args.num_test,
            data_args.train_length,
            min_train_length=data_args.min_train_length,
            test_length=data_args.test_length,
            seed=seed,
            pad_train_to=data_args.test_length if data_args.pad_train_to_test_length else None,
        )
        return (
            ds,
            dict(
                vocab_size=vocab_size(group),
                grid_size=None,
                conv_type="causal_1d",
                causal=True,
                position_embedding_type="none",
                num_prefix_tokens=0,
                max_position_embeddings=max(1024, data_args.test_length),
            ),
            ["length"],
        )
    from looped_training.fprm.tasks.arc import VOCAB_SIZE, build_arc_dataset, load_arc_tasks

    tasks = load_arc_tasks(max_grid_side=data_args.arc_max_grid, max_tasks=data_args.arc_max_tasks)
    ds, num_puzzles = build_arc_dataset(
        tasks, data_args.arc_augmentations, grid_size=data_args.arc_max_grid, translate=True, seed=seed
    )
    return (
        ds,
        dict(
            vocab_size=VOCAB_SIZE,
            grid_size=data_args.arc_max_grid,
            conv_type="causal_1d",
            causal=False,
            position_embedding_type="rope",
            num_puzzle_identifiers=num_puzzles,
        ),
        [],
    )
