from bufreuse.cli import main

main()
