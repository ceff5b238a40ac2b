// Stream an audio file to echoic from Node.js and print the transcript as it comes:
// interim results on stderr, final results (one line per utterance) on stdout.
//
//   npm install --prefix examples/node          # @grpc/grpc-js and @grpc/proto-loader
//   node examples/node/stream.js talk.wav [HOST:PORT]
//
// The stubs come from protos/echoic/v1/transcriber.proto as it is, loaded at run time.
// The file's bytes are sent as they are (WAV, FLAC or Ogg: the server reads the header)
// in pieces of 3,200 bytes, as fast as the server takes them.
"use strict";

const path = require("path");
const fs = require("fs");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const [file, target = "127.0.0.1:50051"] = process.argv.slice(2);
if (!file) {
  console.error("usage: node stream.js FILE [HOST:PORT]");
  process.exit(2);
}

const protos = path.join(__dirname, "..", "..", "protos");
const definition = protoLoader.loadSync(path.join(protos, "echoic/v1/transcriber.proto"), {
  includeDirs: [protos],
  keepCase: true,
  enums: String,
  defaults: true,
});
const { Transcriber } = grpc.loadPackageDefinition(definition).echoic.v1;
const client = new Transcriber(target, grpc.credentials.createInsecure());

const call = client.StreamingRecognize();
call.on("data", (response) => {
  for (const result of response.results) {
    const text = result.alternatives.length ? result.alternatives[0].transcript : "";
    if (result.is_final) console.log(text);
    else console.error(`... ${text}`);
  }
});
call.on("error", (error) => {
  console.error(`echoic: ${error.details || error.message}`);
  process.exit(1);
});
call.on("end", () => client.close());

call.write({
  streaming_config: { config: { encoding: "ENCODING_UNSPECIFIED" }, interim_results: true },
});
const audio = fs.readFileSync(file);
for (let i = 0; i < audio.length; i += 3200) {
  call.write({ audio_content: audio.subarray(i, i + 3200) });
}
call.end();
