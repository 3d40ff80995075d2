// Command etcd is etcd's own server entry point (etcdmain), built from the
// published go.etcd.io/etcd/server/v3 module instead of the etcd repository.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
