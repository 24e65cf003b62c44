from kvcx.cli import main

main()
