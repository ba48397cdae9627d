from batchline.cli import main

raise SystemExit(main())
