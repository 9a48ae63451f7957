import sys

if sys.argv[1:2] == ["bf16-weights"]:  # its own subcommand: python -m benchmarks bf16-weights
    from benchmarks.bf16_weights import main as bf16_weights_main

    bf16_weights_main(sys.argv[2:])
elif sys.argv[1:2] == ["rl"]:  # its own subcommand: python -m benchmarks rl
    from benchmarks.rl import main as rl_main

    rl_main(sys.argv[2:])
else:
    from benchmarks.run import main

    main()
