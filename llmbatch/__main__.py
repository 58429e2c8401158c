from llmbatch.cli import main

main()
