from elasticd.cli import main

main()
