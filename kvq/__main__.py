from kvq.cli import main

main()
